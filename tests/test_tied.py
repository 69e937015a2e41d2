"""Tied parameters -- one tensor under two keys, as transformers ties ``lm_head.weight`` to the input
embedding: written once, listed under both keys, loaded into models that tie them and models that
hold them apart, and left out of full artifacts as ``save_pretrained`` leaves them out."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sim import sim_load, sim_save
from torch import nn

import smpckpt
from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import ReplicaMismatch
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter


@pytest.fixture
def gpt2(transformers_quiet: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    def make(seed: int, **overrides: Any) -> Any:
        torch.manual_seed(seed)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32, **overrides)
        return GPT2LMHeadModel(cfg).eval()

    return make


@pytest.fixture
def transformers_quiet() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _equal_states(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _safetensors_keys(folder: str) -> set[str]:
    keys: set[str] = set()
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        keys |= set(load_file(f))
    return keys


def test_save_pretrained_folder_loads_into_the_hf_model_without_strict_false(tmp_path: Path, gpt2: Any) -> None:
    src = gpt2(0)
    src.save_pretrained(tmp_path / "d", max_shard_size="60KB")
    assert "lm_head.weight" not in _safetensors_keys(str(tmp_path / "d"))  # what save_pretrained writes
    dst = gpt2(1)
    smpckpt.resume_from_checkpoint(str(tmp_path), "d", partial=False, model=dst)
    _equal_states(src, dst)
    assert dst.lm_head.weight is dst.transformer.wte.weight  # the tie survives the load


def test_partial_save_writes_a_tied_tensor_once_and_lists_it_under_both_keys(tmp_path: Path, gpt2: Any) -> None:
    model = gpt2(0)
    opt = torch.optim.Adam(model.parameters())
    root = str(tmp_path)
    smpckpt.save_checkpoint(root, "t", model=model, optimizer=opt, save_rng=False)
    folder = os.path.join(root, "t_partial")
    with open(os.path.join(folder, "smpckpt.manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["extra"]["layout_record"]["tied"] == {"model.lm_head.weight": "model.transformer.wte.weight"}
    md = FsspecStorageReader(folder).read_metadata()
    (head,) = [v for k, v in md.storage_data.items() if k.fqn == "model.lm_head.weight"]
    (embed,) = [v for k, v in md.storage_data.items() if k.fqn == "model.transformer.wte.weight"]
    assert head == embed  # the same bytes of the same file
    # that record is the only one two keys share: the data holds the embedding once
    stored = {(v.relative_path, v.offset) for v in md.storage_data.values()}
    assert len(stored) == len(md.storage_data) - 1
    # resumes into the tied model bit-exact, tie intact
    other = gpt2(1)
    other_opt = torch.optim.Adam(other.parameters())
    smpckpt.resume_from_checkpoint(root, model=other, optimizer=other_opt)
    _equal_states(model, other)
    assert other.lm_head.weight is other.transformer.wte.weight


def test_stock_dcp_load_reads_both_keys_of_a_torch_save_checkpoint(tmp_path: Path, gpt2: Any) -> None:
    import torch.distributed.checkpoint as dcp

    model = gpt2(0)
    smpckpt.save_checkpoint(str(tmp_path), "ts", model=model, format="torch_save", save_rng=False)
    dst = gpt2(1)
    state = {"model": dst.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ts_partial"))  # stock planner and reader
    _equal_states(model, dst)


class _Stage(nn.Module):
    """A model holding the head apart from the embedding (a pipeline's last stage keeps its own copy)."""

    def __init__(self, vocab: int, d: int, tied_in_memory: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied_in_memory:
            self.head.weight = self.embed.weight


def test_a_model_holding_the_head_apart_reads_it_from_the_stored_embedding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tied = _Stage(11, 4, tied_in_memory=True)
    smpckpt.save_checkpoint(str(tmp_path), "a", model=tied, save_rng=False)
    apart = _Stage(11, 4, tied_in_memory=False)
    smpckpt.resume_from_checkpoint(str(tmp_path), "a", model=apart)
    assert torch.equal(apart.head.weight, tied.embed.weight) and torch.equal(apart.embed.weight, tied.embed.weight)
    assert apart.head.weight.data_ptr() != apart.embed.weight.data_ptr()
    # and an untied checkpoint loads into a tied model through its first key
    torch.manual_seed(1)
    src = _Stage(11, 4, tied_in_memory=False)
    with torch.no_grad():
        src.head.weight.copy_(src.embed.weight)
    smpckpt.save_checkpoint(str(tmp_path), "b", model=src, save_rng=False)
    dst = _Stage(11, 4, tied_in_memory=True)
    smpckpt.resume_from_checkpoint(str(tmp_path), "b", model=dst)
    assert torch.equal(dst.embed.weight, src.embed.weight)
    assert smpckpt.last_resume_info().skipped_keys == ()


def test_tied_vocab_parallel_shards_over_two_ranks(tmp_path: Path) -> None:
    """TP=2: each rank's embedding shard is its head shard; written once per rank, loaded at TP=1."""
    layout, specs = ParallelLayout(tp=2), {"model.embed": ShardSpec(0), "model.head": ShardSpec(0)}
    full = torch.randn(10, 4)
    sds = []
    for r in range(2):
        piece = full.chunk(2)[r].clone()
        sds.append({"model": {"embed": piece, "head": piece}})
    sim_save(
        sds,
        [ParallelSavePlanner(layout, specs, rank=r) for r in range(2)],
        [FsspecStorageWriter(str(tmp_path)) for _ in range(2)],
    )
    md = FsspecStorageReader(str(tmp_path)).read_metadata()
    assert set(md.state_dict_metadata) == {"model.embed", "model.head"}
    dest = [{"model": {"embed": torch.zeros(10, 4), "head": torch.zeros(10, 4)}}]
    sim_load(dest, [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path))])
    assert torch.equal(dest[0]["model"]["embed"], full) and torch.equal(dest[0]["model"]["head"], full)


def test_ranks_that_tie_differently_fail_the_save_naming_the_keys(tmp_path: Path) -> None:
    layout = ParallelLayout(dp=2)
    w = torch.randn(6, 3)
    sds = [{"model": {"embed": w, "head": w}}, {"model": {"embed": w.clone(), "head": w.clone()}}]
    with pytest.raises(ReplicaMismatch, match=r"disagree .* tied parameters\): stage 0: ranks \[0\] .* ranks \[1\]"):
        sim_save(
            sds,
            [ParallelSavePlanner(layout, rank=r, replica_owner="lowest") for r in range(2)],
            [FsspecStorageWriter(str(tmp_path / "x")) for _ in range(2)],
        )


def test_full_artifact_follows_tie_word_embeddings(tmp_path: Path, gpt2: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = gpt2(0)
    root = str(tmp_path)
    fresh = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32)  # never saved: no architectures
    smpckpt.save_checkpoint(root, "tied", partial=False, model=model, hf_config=fresh)
    folder = os.path.join(root, "tied")
    assert "lm_head.weight" not in _safetensors_keys(folder)
    assert len(_safetensors_keys(folder)) == len(model.state_dict()) - 1
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["dtype"] == "float32"
    back = GPT2LMHeadModel.from_pretrained(folder).eval()
    _equal_states(model, back)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    # our own loader reads it back into the tied model without strict=False
    dst = gpt2(2)
    smpckpt.resume_from_checkpoint(root, "tied", partial=False, model=dst)
    _equal_states(model, dst)
    # a config that unties them gets both tensors, as save_pretrained would write them
    untied = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32, tie_word_embeddings=False)
    smpckpt.save_checkpoint(root, "untied", partial=False, model=model, hf_config=untied, dtype=torch.bfloat16)
    assert "lm_head.weight" in _safetensors_keys(os.path.join(root, "untied"))
    with open(os.path.join(root, "untied", "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"


class _Apart(nn.Module):
    """GPT-2's embedding and head under HF's names, held apart (a pipeline's last stage holds its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(97, 32)
        self.lm_head = nn.Linear(32, 97, bias=False)


@pytest.mark.parametrize("how", ["config.json", "translation"])
def test_hf_folder_without_its_head_fills_a_head_held_apart(tmp_path: Path, gpt2: Any, how: str) -> None:
    """A folder that leaves the tied head out gives a model holding the head apart the embedding's
    values: by the folder's config.json (model_type gpt2), or by the translation's ties."""
    from safetensors.torch import save_file

    src = gpt2(0)
    folder = tmp_path / "d"
    src.config.save_pretrained(folder)
    if how == "translation":
        os.remove(folder / "config.json")
    save_file(
        {"transformer.wte.weight": src.transformer.wte.weight.detach().contiguous()}, str(folder / "model.safetensors")
    )
    apart = _Apart()
    translation = smpckpt.hf.gpt2.TRANSLATION if how == "translation" else None
    smpckpt.resume_from_checkpoint(str(folder), partial=False, model=apart, translate_function=translation)
    assert torch.equal(apart.lm_head.weight, src.transformer.wte.weight)
    assert torch.equal(apart.transformer.wte.weight, src.transformer.wte.weight)
    if how == "config.json":  # a config that unties them ties nothing: the head is then missing
        with open(folder / "config.json") as f:
            cfg = json.load(f)
        with open(folder / "config.json", "w") as f:
            json.dump({**cfg, "tie_word_embeddings": False}, f)
        with pytest.raises(smpckpt.LayoutMismatch, match="lm_head.weight"):
            smpckpt.resume_from_checkpoint(str(folder), partial=False, model=_Apart())


def test_meta_and_empty_tensors_of_one_shape_are_not_tied() -> None:
    """Every meta tensor and every empty one reports address 0: same-shaped ones are not one tensor. (The
    planning benchmarks plan on meta tensors; seen as tied, all but one key per shape left the plan.)"""
    state = {
        "model": {
            **{f"layers.{i}.weight": torch.empty(64, 32, device="meta") for i in range(4)},
            **{f"layers.{i}.bias": torch.empty(0) for i in range(2)},
        }
    }
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=True)
    assert planner.tied == {}
    plan = planner.create_local_plan()
    assert sorted(item.index.fqn for item in plan.items) == sorted(f"model.{k}" for k in state["model"])


def test_a_real_tie_is_still_found_next_to_meta_tensors() -> None:
    w = torch.randn(8, 4)
    state = {"model": {"embed.weight": w, "head.weight": w, "other": torch.empty(8, 4, device="meta")}}
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=True)
    assert planner.tied == {"model.head.weight": "model.embed.weight"}


def _untied_folder(folder: Path, gpt2: Any) -> Any:
    """A save_pretrained folder of a GPT-2 whose head is its own tensor, different from its embedding."""
    src = gpt2(3, tie_word_embeddings=False)
    with torch.no_grad():
        src.lm_head.weight.copy_(torch.randn_like(src.lm_head.weight))
    assert not torch.equal(src.lm_head.weight, src.transformer.wte.weight)
    src.save_pretrained(folder)
    return src


def test_a_tied_model_refuses_a_head_that_differs_from_its_embedding(tmp_path: Path, gpt2: Any) -> None:
    """transformers keeps the two apart (it unties); a tied model holds one value, so the load names both
    keys -- from a Hugging Face folder and from a partial checkpoint -- unless keep_tied says which."""
    src = _untied_folder(tmp_path / "hf", gpt2)
    dst = gpt2(4)  # tie_word_embeddings=True: lm_head.weight is transformer.wte.weight
    before = dst.transformer.wte.weight.detach().clone()
    with pytest.raises(smpckpt.LayoutMismatch, match=r"'model\.lm_head\.weight' and 'model\.transformer\.wte\.weight'"):
        smpckpt.resume_from_checkpoint(str(tmp_path / "hf"), partial=False, model=dst)
    assert dst.lm_head.weight is dst.transformer.wte.weight
    # keep the head: the tied tensor takes its values (and the embedding's are ignored)
    smpckpt.resume_from_checkpoint(str(tmp_path / "hf"), partial=False, model=dst, keep_tied=["model.lm_head.weight"])
    assert torch.equal(dst.transformer.wte.weight, src.lm_head.weight) and not torch.equal(dst.lm_head.weight, before)
    assert dst.lm_head.weight is dst.transformer.wte.weight
    smpckpt.resume_from_checkpoint(str(tmp_path / "hf"), partial=False, model=dst, keep_tied=["*wte*"])
    assert torch.equal(dst.lm_head.weight, src.transformer.wte.weight)
    # a partial checkpoint of the untied model, resumed into the tied one
    smpckpt.save_checkpoint(str(tmp_path / "run"), "u", model=src, save_rng=False)
    with pytest.raises(smpckpt.LayoutMismatch, match=r"keep_tied=\['model\.transformer\.wte\.weight'\]"):
        smpckpt.resume_from_checkpoint(str(tmp_path / "run"), "u", model=dst)
    smpckpt.resume_from_checkpoint(str(tmp_path / "run"), "u", model=dst, keep_tied=["model.lm_head.weight"])
    assert torch.equal(dst.transformer.wte.weight, src.lm_head.weight)
    # a model that holds them apart loads both, and a tied model loads a checkpoint whose two are equal
    apart = gpt2(5, tie_word_embeddings=False)
    smpckpt.resume_from_checkpoint(str(tmp_path / "hf"), partial=False, model=apart)
    _equal_states(src, apart)
    with torch.no_grad():
        src.lm_head.weight.copy_(src.transformer.wte.weight)
    smpckpt.save_checkpoint(str(tmp_path / "run"), "equal", model=src, save_rng=False)
    smpckpt.resume_from_checkpoint(str(tmp_path / "run"), "equal", model=dst)
    assert torch.equal(dst.lm_head.weight, src.lm_head.weight)


@pytest.mark.parametrize("differs_on", [0, 1])
def test_tied_vocab_parallel_shards_refuse_a_head_apart_that_differs_on_one_rank(
    tmp_path: Path, differs_on: int
) -> None:
    """TP=2: each rank compares its own shard of the head with its shard of the embedding."""
    full = torch.randn(10, 4)
    head = full.clone()
    head[5 * differs_on + 2, 1] += 1.0  # one element, in one rank's half
    sim_save(
        [{"model": {"embed": full, "head": head}}],
        [ParallelSavePlanner(ParallelLayout(), rank=0)],
        [FsspecStorageWriter(str(tmp_path))],
    )
    layout, specs = ParallelLayout(tp=2), {"model.embed": ShardSpec(0), "model.head": ShardSpec(0)}
    dests = []
    for _ in range(2):
        piece = torch.zeros(5, 4)
        dests.append({"model": {"embed": piece, "head": piece}})
    with pytest.raises(smpckpt.LayoutMismatch, match=rf"rank {differs_on}: 'model\.head' and 'model\.embed'"):
        sim_load(
            dests,
            [ParallelLoadPlanner(layout, specs, rank=r) for r in range(2)],
            [FsspecStorageReader(str(tmp_path)) for _ in range(2)],
        )
    sim_load(
        dests,
        [ParallelLoadPlanner(layout, specs, rank=r, keep_tied=["model.head"]) for r in range(2)],
        [FsspecStorageReader(str(tmp_path)) for _ in range(2)],
    )
    assert torch.equal(torch.cat([d["model"]["embed"] for d in dests]), head)


def test_keep_tied_naming_both_keys_of_one_tensor_is_refused_when_they_differ(tmp_path: Path) -> None:
    """keep_tied globs matching both keys of a tied tensor the checkpoint holds apart with different values
    (``["model.*"]``, or both names) loaded the destination's first key in silence, whatever the order the
    globs were given in (hunt62a); which one to keep is the caller's to say: refused naming both. Equal
    copies are no choice (either gives the same values): they load (rev62e R5)."""
    for head_value in (1.0, 0.0):
        store = str(tmp_path / str(head_value))
        sim_save(
            [{"model": {"embed": torch.zeros(4, 2), "head": torch.full((4, 2), head_value)}}],
            [ParallelSavePlanner(ParallelLayout(), rank=0)],
            [FsspecStorageWriter(store)],
        )
        for keep in (["model.*"], ["model.head", "model.embed"]):
            piece = torch.full((4, 2), 7.0)
            dest = {"model": {"embed": piece, "head": piece}}
            planners = [ParallelLoadPlanner(ParallelLayout(), rank=0, keep_tied=keep)]
            if head_value:
                with pytest.raises(
                    smpckpt.LayoutMismatch, match=r"keep_tied matches both 'model\.embed' and 'model\.head'.*differ"
                ):
                    sim_load([dest], planners, [FsspecStorageReader(store)])
            else:
                sim_load([dest], planners, [FsspecStorageReader(store)])
                assert torch.equal(piece, torch.zeros(4, 2))


@pytest.mark.parametrize(
    ("keep", "want"),
    [
        (["model.encoder.embed_tokens.weight"], 1.0),  # an alias the checkpoint ties to shared selects shared
        (["model.shared.weight", "model.encoder.embed_tokens.weight"], 1.0),  # both reach one stored tensor
        (["model.decoder.embed_tokens.weight"], 2.0),
        (["model.*.embed_tokens.weight"], "'model.decoder.embed_tokens.weight' and 'model.encoder.embed_tokens"),
        (["model.shared.weight", "model.decoder.embed_tokens.weight"], "'model.decoder.embed_tokens.weight' and"),
    ],
)
def test_keep_tied_over_a_tie_of_three_keys_selects_by_stored_tensor(
    tmp_path: Path, keep: list[str], want: Any
) -> None:
    """A T5-like tie of three keys, the checkpoint storing shared and encoder tied (1.0) and decoder apart
    (2.0): a glob matching encoder and decoder loaded decoder in silence, and naming encoder alone was
    ignored (refused, advising what was passed): every matching key now selects the tensor the checkpoint
    stores it as, and matches reaching two different stored tensors are refused (rev62e R1)."""
    s = torch.full((4, 2), 1.0)
    saved = {"shared.weight": s, "encoder.embed_tokens.weight": s, "decoder.embed_tokens.weight": s + 1}
    sim_save([{"model": saved}], [ParallelSavePlanner(ParallelLayout(), rank=0)], [FsspecStorageWriter(str(tmp_path))])
    t = torch.zeros(4, 2)
    dest = {"model": {"shared.weight": t, "encoder.embed_tokens.weight": t, "decoder.embed_tokens.weight": t}}
    load = functools.partial(
        sim_load,
        [dest],
        [ParallelLoadPlanner(ParallelLayout(), rank=0, keep_tied=keep)],
        [FsspecStorageReader(str(tmp_path))],
    )
    if isinstance(want, str):
        with pytest.raises(smpckpt.LayoutMismatch, match="keep_tied matches both " + re.escape(want)):
            load()
    else:
        load()
        assert torch.equal(t, torch.full((4, 2), want))


class _PipeStage(nn.Module):
    """Stage ``stage`` of ``pp`` (the embedding on the first, its own head on the last); pp=1 ties them."""

    def __init__(self, stage: int, pp: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        embed, head = nn.Embedding(11, 4), nn.Linear(4, 11, bias=False)
        with torch.no_grad():
            head.weight.copy_(embed.weight)
        self.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(2 // pp))
        if stage == 0:
            self.embed = embed
        if stage == pp - 1:
            self.head = head
        if pp == 1:
            self.head.weight = self.embed.weight


def _tie_apart(model: nn.Module) -> list[dict[str, Any]]:
    """Param groups: the layers, then the embedding and head (a group of their own)."""
    tied = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return [{"params": list(model.layers.parameters())}, {"params": tied}]


def _save_pp2_stages(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Tag "same": the tie's gradient all-reduced (head and embedding alike); "drift": the head's gradient
    differs, so its weights and Adam moments drift from the embedding's; "moments": one moment differs;
    "lr": equal tensors, the head's lr differs; "frozen": the head had no gradient (no state), the embedding
    a zero one (Adam state, its weights unchanged: equal to the head's). Returns each
    tag's Adam state."""
    out = {}
    for tag, head_grad in (("same", -0.25), ("drift", 0.5), ("moments", -0.25), ("lr", -0.25), ("frozen", None)):
        model = _PipeStage(rank, 2)
        opt = torch.optim.Adam(_tie_apart(model), lr=0.1)
        for name, p in model.named_parameters():
            grad = (-0.25 if head_grad is None else head_grad) if rank == 1 else -0.25 if head_grad else 0.0
            p.grad = None if head_grad is None and name == "head.weight" else torch.full_like(p, grad)
        opt.step()
        if tag == "moments" and rank == 1:  # equal weights, one moment apart
            opt.state[model.head.weight]["exp_avg"][0, 0] += 1.0
        if tag == "lr" and rank == 1:  # equal tensors, the head's param group apart
            opt.param_groups[1]["lr"] = 0.05
        smpckpt.save_checkpoint(root, tag, model=model, optimizer=opt, layout=ParallelLayout(pp=2, pp_layers=(1, 1)))
        param = model.embed.weight if rank == 0 else model.head.weight
        out[tag] = {"weight": param.detach().clone(), **{k: v.clone() for k, v in opt.state[param].items()}}
    return out


@pytest.mark.dist
def test_a_tie_held_apart_by_pipeline_stages_loads_with_its_own_optimizer_state(tmp_path: Path) -> None:
    """A tied embedding/head trained under PP (each stage its own copy) resumed into a model that ties them:
    keep_tied's choice brought that key's weights but the other key's Adam moments, and a strict resume was
    refused for the other key's optimizer state (loaded by no rank), tie or no tie (hunt62a). The state now
    follows the weights: the key kept, or, without keep_tied, the two keys' states compared as the weights."""
    from dist_harness import run_world

    saved = run_world(_save_pp2_stages, 2, str(tmp_path), timeout=180)
    embed, head = saved[0]["drift"], saved[1]["drift"]
    assert not torch.equal(embed["exp_avg"], head["exp_avg"])
    for keep, want in ((["model.head.weight"], head), (["model.embed.weight"], embed), ((), saved[0]["same"])):
        model = _PipeStage(0, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        options = smpckpt.ResumeOptions(keep_tied=keep)  # strict
        smpckpt.resume_from_checkpoint(
            str(tmp_path), "drift" if keep else "same", model=model, optimizer=opt, options=options
        )
        assert torch.equal(model.embed.weight, want["weight"]), keep
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[model.embed.weight][name], want[name]), (keep, name)
        assert smpckpt.last_resume_info().skipped_keys == ()
    model = _PipeStage(0, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"'optim\.state\.head\.weight\.exp_avg' and 'optim\.state\.embed.*keep_tied=\['model\.embed\.weight'\]",
    ):
        smpckpt.resume_from_checkpoint(str(tmp_path), "moments", model=model, optimizer=opt)
    # a copy's objects (a param group's lr) compared like its tensors: the embedding's were taken silently
    model = _PipeStage(0, 1)
    opt = torch.optim.Adam(_tie_apart(model), lr=0.7)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"'optim\.param_groups\.head\.weight\.lr' and 'optim\.param_groups\.embed\.weight\.lr'.*"
        r"keep_tied=\['model\.embed\.weight'\]",
    ):
        smpckpt.resume_from_checkpoint(str(tmp_path), "lr", model=model, optimizer=opt)
    for keep, lr in ((["model.head.weight"], 0.05), (["model.embed.weight"], 0.1)):
        opt = torch.optim.Adam(_tie_apart(model), lr=0.7)
        options = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "lr", model=model, optimizer=opt, options=options)
        assert opt.param_groups[1]["lr"] == lr, keep
    # a copy saved without state (frozen head) resumes without, strict, whichever keep_tied names (hunt62/rev62g
    # F6: keep_tied=head was refused naming the embedding's state, which the checkpoint holds, as absent)
    for keep, want in ((["model.head.weight"], saved[1]["frozen"]), (["model.embed.weight"], saved[0]["frozen"])):
        model = _PipeStage(0, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        options = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "frozen", model=model, optimizer=opt, options=options)
        assert torch.equal(model.embed.weight, want["weight"]), keep
        state = opt.state.get(model.embed.weight, {})
        assert sorted(state) == sorted(k for k in want if k != "weight"), keep
        assert all(torch.equal(state[k], want[k]) for k in state), keep
        stateless = () if state else tuple(f"optim.state.embed.weight.{k}" for k in ("exp_avg", "exp_avg_sq", "step"))
        assert smpckpt.last_resume_info().skipped_keys == stateless, keep  # as any parameter saved without state
    # without keep_tied, a copy with state and one without differ, equal weights or not (were: the state kept)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"rank 0: 'model\.head\.weight' and 'model\.embed\.weight' .*only one holds optim\.state\.embed\.weight\."
        r"exp_avg, .*keep_tied=\['model\.embed\.weight'\]",
    ) as caught:
        smpckpt.resume_from_checkpoint(str(tmp_path), "frozen", model=model, optimizer=opt)
    # the planner's own refusal names its rank, as its other load refusals do (it did not: rev63 item 4)
    assert str(caught.value.__cause__.failures[0][0]).startswith("rank 0: 'model.head.weight' and "), caught.value


def test_a_tie_saved_tied_resumes_through_one_read_whichever_key_keep_tied_names(tmp_path: Path) -> None:
    """rev62h F1/F2: a tie saved tied (one tensor listed under both keys) resumed into the same tied model
    with Adam: keep_tied naming the alias (the README's own example) was refused ("14 keys are not in the
    checkpoint: optim.state..."), and without keep_tied the tensor was read twice, into scratch, and
    compared (a copy of the embedding per resume)."""
    from smpckpt.planners import _shared_memory

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(7, 3)
            self.head = nn.Linear(3, 7, bias=False)
            self.head.weight = self.embed.weight

    m = Tied()
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m.embed.weight.grad = torch.full((7, 3), -0.25)
    o.step()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=m, optimizer=o)
    compared: list[dict[str, str]] = []
    real = _shared_memory.TiedLoads.plan

    def plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        real(self, *args, **kwargs)
        compared.append(dict(self.compare))

    _shared_memory.TiedLoads.plan = plan  # type: ignore[method-assign]
    try:
        for keep in ([], ["model.embed.weight"], ["model.head.weight"], ["model.*"]):
            dm = Tied()
            do = torch.optim.Adam(dm.parameters(), lr=0.1)
            opts = smpckpt.ResumeOptions(keep_tied=keep)
            smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dm, optimizer=do, options=opts)
            assert compared[-1] == {}, (keep, compared[-1])  # one read, nothing into scratch
            assert torch.equal(dm.embed.weight, m.embed.weight) and dm.head.weight is dm.embed.weight, keep
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(do.state[dm.embed.weight][name], o.state[m.embed.weight][name]), (keep, name)
    finally:
        _shared_memory.TiedLoads.plan = real  # type: ignore[method-assign]


@pytest.mark.parametrize("case", ["four_keys_equal", "four_keys_differ", "head_declared_first"])
def test_a_tie_of_aliases_follows_its_stored_copies_optimizer_state(tmp_path: Path, case: str) -> None:
    """rev62i F1: a T5-like tie of four keys saved as two tied pairs (pipeline stages) with equal values and
    Adam state was refused as "only one holds optim..." (an alias's state lies under its stored key);
    rev62i F2 / rev62h F5: a tied model declaring the head first could not resume the optimizer state of a
    checkpoint that stores the tensor under the embedding ("14 keys are not in the checkpoint")."""
    names = ("shared", "encoder", "decoder", "lm_head") if case != "head_declared_first" else ("head", "embed")

    def build(tie_all: bool, order: tuple[str, ...]) -> nn.Module:
        m = nn.Module()
        for n in order:
            setattr(m, n, nn.Linear(3, 5, bias=False))
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(5, 3))
        v = w if tie_all or len(order) == 2 else nn.Parameter(w.detach().clone())
        for i, n in enumerate(order):
            getattr(m, n).weight = w if i < len(order) // 2 or len(order) == 2 else v
        return m

    src = build(False, names if len(names) == 4 else ("embed", "head"))
    o = torch.optim.Adam(src.parameters(), lr=0.1)
    for i, p in enumerate(src.parameters()):
        p.grad = torch.full_like(p, -0.25 if i == 0 or case != "four_keys_differ" else 0.5)
    o.step()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=src, optimizer=o)
    want = next(iter(src.parameters()))
    dest = build(True, names)
    do = torch.optim.Adam(dest.parameters(), lr=0.1)
    if case == "four_keys_differ":
        with pytest.raises(smpckpt.LayoutMismatch, match="with different values"):
            smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dest, optimizer=do)
        return
    for keep in ([], [f"model.{names[0]}.weight"], [f"model.{names[-1]}.weight"]):
        dest = build(True, names)
        do = torch.optim.Adam(dest.parameters(), lr=0.1)
        opts = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dest, optimizer=do, options=opts)
        (p,) = dest.parameters()
        assert torch.equal(p, want), keep
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(do.state[p][name], o.state[want][name]), (keep, name)


class _StepKinds(torch.optim.Optimizer):
    """Keeps a ``step`` per parameter, as a 0-d tensor for those in ``as_tensor``, else a Python int (two
    pipeline stages' optimizers of one tie may differ so)."""

    def __init__(self, params: Any, as_tensor: tuple[nn.Parameter, ...] = ()) -> None:
        super().__init__(params, {"lr": 0.1})
        self.as_tensor = {id(p) for p in as_tensor}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0) if id(p) in self.as_tensor else 0
                state["step"] += 1


class _EmbedHead(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(6, 3), nn.Linear(3, 6, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            self.head.weight = nn.Parameter(self.embed.weight.detach().clone())


@pytest.mark.parametrize("dest_step", ["int", "tensor"])
@pytest.mark.parametrize("tensor_on", ["head", "embed"])
def test_a_tie_held_apart_whose_copies_saved_step_as_tensor_and_int(
    tmp_path: Path, dest_step: str, tensor_on: str
) -> None:
    """rev62i F2/F3: one copy's ``step`` saved as a 0-d tensor, the other's as an int: equal values load
    (an internal AttributeError before), differing ones are refused naming both keys."""
    src = _EmbedHead(tied=False)
    opt = _StepKinds(src.parameters(), (getattr(src, tensor_on).weight,))
    opt.step()
    opt.step()
    smpckpt.save_checkpoint(str(tmp_path), "same", model=src, optimizer=opt)
    opt.state[src.head.weight]["step"] += 1
    smpckpt.save_checkpoint(str(tmp_path), "differ", model=src, optimizer=opt)
    for tag in ("same", "differ"):
        dst = _EmbedHead(tied=True)
        dopt = _StepKinds(dst.parameters(), (dst.embed.weight,) if dest_step == "tensor" else ())
        # the live step made the tensor copy's (head 3, embed 2): it was compared with the live value when
        # the other copy's object arrived after it, and such differing copies loaded in silence
        for _ in range(1 if tag == "same" else 3 if tensor_on == "head" else 2):
            dopt.step()
        if tag == "differ":
            with pytest.raises(smpckpt.LayoutMismatch) as caught:
                smpckpt.resume_from_checkpoint(str(tmp_path), tag, model=dst, optimizer=dopt)
            assert "'optim.state.head.weight.step' and 'optim.state.embed.weight.step'" in str(caught.value)
            continue
        smpckpt.resume_from_checkpoint(str(tmp_path), tag, model=dst, optimizer=dopt)
        step = dopt.state[dst.embed.weight]["step"]
        assert type(step) is (torch.Tensor if dest_step == "tensor" else int) and step == 2
        assert torch.equal(dst.embed.weight, src.embed.weight)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (2.0, 2, True),  # rev63b F2: refused as different before
        (float("nan"), float("nan"), True),
        (torch.tensor(float("nan")), float("nan"), True),
        (torch.tensor(True), True, True),
        (torch.tensor(2.0), 2, True),
        (True, 1, False),
        (2, 3, False),
        (torch.tensor([2.0]), 2.0, False),
        ({"a": 1}, {"a": 1}, True),
    ],
)
def test_tie_copies_saved_as_numbers_are_compared_by_value(a: Any, b: Any, same: bool) -> None:
    from smpckpt.planners._shared_memory import _same_object

    assert _same_object(a, b) is same and _same_object(b, a) is same


def test_planning_a_head_first_tie_splits_only_the_tied_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """rev62k F2: a tie whose head is declared first had every optimizer key of the model split by owner
    on each resume (seconds at 280k keys). Counted, not timed: the owner lookups stay those of the tie."""
    from smpckpt.model.layout import ReservedKeys
    from smpckpt.planners._shared_memory import TiedLoads

    calls: list[str] = []
    owner = ReservedKeys.state_owner
    monkeypatch.setattr(
        ReservedKeys, "state_owner", staticmethod(lambda rest, params: calls.append(rest) or owner(rest, params))
    )

    def keys(p: str) -> list[str]:
        return [f"model.{p}", f"optim.state.{p}.exp_avg", f"optim.param_groups.{p}.lr"]

    params = [f"layers.{i}.w" for i in range(2000)]
    md_all = {k: None for p in [*params, "embed.weight"] for k in keys(p)} | {"model.head.weight": None}
    entries: dict[str, Any] = {k: None for p in [*params, "head.weight"] for k in keys(p)} | {
        "model.embed.weight": None
    }
    ties = TiedLoads(None)
    ties.plan(
        entries, {"model.embed.weight": "model.head.weight"}, {"model.head.weight": "model.embed.weight"}, md_all, 0
    )
    assert ties.sources == {
        "optim.state.head.weight.exp_avg": "optim.state.embed.weight.exp_avg",
        "optim.param_groups.head.weight.lr": "optim.param_groups.embed.weight.lr",
    }
    assert ties.through == {"model.embed.weight": "model.head.weight"}
    assert len(calls) == 4, calls[:8]  # the dest's two keys of the tie and the checkpoint's two


# fix69d F4: a conjugate or negated view shares its memory's address, dtype, shape and strides, yet shows other
# values: taken as a tie, the save wrote the plain view once and loaded it under both keys (conjugate lost)
_C = torch.tensor([1 + 2j, 3 - 4j, -5j], dtype=torch.complex64)
_VIEWS = {
    "conjugate": lambda c: {"a": c, "b": c.conj()},
    "negated": lambda c: {"a": c.imag, "b": c.conj().imag},
    "negated conjugate": lambda c: {"a": c.conj(), "b": c.conj().imag, "c": c.imag},
}


@pytest.mark.parametrize("case", sorted(_VIEWS))
def test_a_conjugate_or_negated_view_is_saved_with_its_own_values(tmp_path: Path, case: str) -> None:
    state = _VIEWS[case](_C.clone())
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    sim_save([state], [planner], [FsspecStorageWriter(str(tmp_path))])
    assert planner.tied == {}
    dest = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    sim_load([dest], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path))])
    for key, value in state.items():
        assert torch.equal(dest[key], value.resolve_conj().resolve_neg()), key


class _Conj(nn.Module):
    """A complex parameter, a buffer that is its conjugate view and one that is its imaginary part negated."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(_C.clone())
        self.register_buffer("wc", self.w.detach().conj())
        self.register_buffer("neg_imag", self.w.detach().conj().imag)


@pytest.mark.parametrize("how", ["sync", "async", "async overlap_staging"])
def test_a_conjugate_view_buffer_resumes_with_its_own_values(tmp_path: Path, how: str) -> None:
    src = _Conj()
    if how == "sync":
        smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=smpckpt.SaveOptions(save_rng=False))
    else:
        opts = smpckpt.AsyncOptions(enabled=True, overlap_staging=how.endswith("staging"))
        with smpckpt.Checkpointer(str(tmp_path), async_options=opts) as ckpt:
            ckpt.save("t", src).result()
    with open(tmp_path / "t_partial" / "smpckpt.manifest.json") as f:
        assert not json.load(f)["extra"]["layout_record"].get("tied")
    dst = _Conj()
    with torch.no_grad():
        dst.w.zero_()
    dst.wc, dst.neg_imag = torch.zeros(3, dtype=torch.complex64), torch.zeros(3)  # buffers of their own
    smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dst)
    assert torch.equal(dst.w, _C) and torch.equal(dst.wc, _C.conj()) and torch.equal(dst.neg_imag, -_C.imag)


def test_a_full_artifact_holds_a_conjugate_view_under_its_own_key(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from smpckpt.storage import FullArtifactWriter, FullOptions

    c = _C.clone()
    writer = FullArtifactWriter(str(tmp_path / "f"), full=FullOptions(format="torch_save"))
    dcp.save({"a": c, "b": c.conj()}, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout()))
    stored: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(tmp_path / "f" / "*.bin")):
        stored.update(torch.load(f, weights_only=True))
    assert sorted(stored) == ["a", "b"]
    assert torch.equal(stored["a"], _C) and torch.equal(stored["b"], _C.conj())


def test_a_translate_function_resume_gives_views_of_one_memory_their_own_destinations(tmp_path: Path) -> None:
    """Loaded aside (a translate_function), keys over one memory seen the same way share one destination; a
    conjugate or negated view, or one as another dtype, gets its own (the dtype view was refused as a dtype
    mismatch, the conjugate pair as a tie whose saved values differ)."""
    models = _Conj(), _Conj()
    for model in models:
        model.register_buffer("f", torch.tensor([1.5, -2.0, 3.0]))
        model.register_buffer("bits", model.f.view(torch.int32))
    src, dst = models
    smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=smpckpt.SaveOptions(save_rng=False))
    with torch.no_grad():
        dst.w.zero_(), dst.f.zero_()
    smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dst, translate_function=lambda sd: sd)
    assert torch.equal(dst.w, _C) and torch.equal(dst.wc, _C.conj()) and torch.equal(dst.neg_imag, -_C.imag)
    assert torch.equal(dst.bits, src.bits) and torch.equal(dst.f, src.f)


def test_an_hf_head_that_is_a_conjugate_view_of_its_embedding_is_not_tied() -> None:
    from smpckpt.hf._common import _tied

    embed = _C.clone().reshape(3, 1)
    assert _tied(embed, embed) and not _tied(embed.conj(), embed) and not _tied(embed.imag, embed.conj().imag)


def test_an_old_checkpoint_tying_a_conjugate_view_to_its_base_resumes_as_it_did(tmp_path: Path) -> None:
    """rev69f F1: tests/data/conj_v0 (smpckpt 55b1992 recorded ``wc = w.conj()`` as a tie of ``w``, storing ``w``)
    resumed into the same model was refused once conjugate views were told apart (memory holding two values):
    ``w`` alone loads, ``wc`` shows it through its view as when it was saved, and a warning names both."""
    import shutil

    shutil.copytree(Path(__file__).parent / "data" / "conj_v0", tmp_path / "c")
    dst = nn.Module()
    dst.w = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    dst.register_buffer("wc", dst.w.detach().conj())
    with pytest.warns(UserWarning, match=r"model\.wc: the checkpoint records it as a tie of model\.w .*conjugate"):
        smpckpt.resume_from_checkpoint(str(tmp_path / "c"), "t", model=dst)
    saved = torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j])  # make_quantized_conj_v0.py's Conj.w
    assert torch.equal(dst.w.detach(), saved) and torch.equal(dst.wc.resolve_conj(), saved.conj())


_OUT = {
    f"{p}.head.weight{s}": f"{p}.out.weight{s}"
    for p in ("optim.state", "optim.param_groups")
    for s in (".exp_avg", ".exp_avg_sq", ".step", ".lr", ".betas", ".eps", ".weight_decay", ".amsgrad", ".maximize")
    + (".foreach", ".capturable", ".differentiable", ".fused", ".decoupled_weight_decay")
} | {"model.head.weight": "model.out.weight"}
_PREFIX_MAPS = {  # as tests/api/test_optimizer_state.py's _MAPS: name_maps moving the model's or optimizer's prefix
    "model-to-net": lambda k: "net." + k[6:] if k.startswith("model.") else k,
    "model-only-under-body": lambda k: "model.body." + k[6:] if k.startswith("model.") else k,
    "optim-to-opt": lambda k: "opt." + k[6:] if k.startswith("optim.") else k,
    "all-under-stage": lambda k: "stage/" + k if k.startswith(("model.", "optim.")) else k,
    # a dict of whole keys (no prefix moved): the head's keys renamed one by one (rev72q: refused by 7614b74)
    "exact-dict": lambda k: _OUT.get(k, k),
    # the same, strict (a dict's __getitem__): called on a probe name it was never given, a resume of a healthy tie
    # held apart ended in KeyError 'optim.state.embed.weight.\x00' (fix73a)
    "strict-dict": {
        **{k.replace(".head.", ".embed."): k.replace(".head.", ".embed.") for k in _OUT},
        **_OUT,
    }.__getitem__,
}


@pytest.mark.parametrize("name_map", list(_PREFIX_MAPS.values()), ids=list(_PREFIX_MAPS))
def test_a_tie_held_apart_loads_its_kept_copys_optimizer_state_through_a_name_map(
    tmp_path: Path, name_map: Any
) -> None:
    """rev72l H1: copies of a tie saved apart, resumed into a tied model under a prefix-moving name_map: strict
    was refused ("14 checkpoint keys are loaded by no rank: opt.param_groups.head.weight.amsgrad, ..."), and
    strict=False loaded the kept copy's weights with the other copy's moments (silently)."""
    src = _EmbedHead(tied=False)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    src.embed.weight.grad, src.head.weight.grad = torch.full((6, 3), -0.25), torch.full((6, 3), 0.5)
    opt.step()
    sharding = smpckpt.Sharding(name_map=name_map)
    smpckpt.save_checkpoint(str(tmp_path), "a", model=src, optimizer=opt, options=sharding)
    for kept in (src.head.weight, src.embed.weight):
        keep = name_map("model.head.weight" if kept is src.head.weight else "model.embed.weight")
        for strict in (True, False):
            dst = _EmbedHead(tied=True)
            dopt = torch.optim.Adam(dst.parameters(), lr=0.1)
            options = [sharding, smpckpt.ResumeOptions(keep_tied=[keep], strict=strict)]
            smpckpt.resume_from_checkpoint(str(tmp_path), "a", model=dst, optimizer=dopt, options=options)
            assert torch.equal(dst.embed.weight, kept), (keep, strict)
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(dopt.state[dst.embed.weight][name], opt.state[kept][name]), (keep, strict, name)
    # equal weights, differing moments, no keep_tied: refused naming the mapped keys (and mapped keep_tied advice)
    with torch.no_grad():
        src.head.weight.copy_(src.embed.weight)
    smpckpt.save_checkpoint(str(tmp_path), "b", model=src, optimizer=opt, options=sharding)
    dst = _EmbedHead(tied=True)
    with pytest.raises(smpckpt.LayoutMismatch) as caught:
        smpckpt.resume_from_checkpoint(
            str(tmp_path), "b", model=dst, optimizer=torch.optim.Adam(dst.parameters()), options=sharding
        )
    want = f"'{name_map('optim.state.head.weight.exp_avg')}' and '{name_map('optim.state.embed.weight.exp_avg')}'"
    assert want in str(caught.value) and f"keep_tied=['{name_map('model.embed.weight')}']" in str(caught.value)
