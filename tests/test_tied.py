"""Tied parameters -- one tensor under two keys, as transformers ties ``lm_head.weight`` to the input
embedding: written once, listed under both keys, loaded into models that tie them and models that
hold them apart, and left out of full artifacts as ``save_pretrained`` leaves them out. The tie's optimizer
state is test_tied_optim.py's; conjugate and negated views (no ties) are test_tied_views.py's."""

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
