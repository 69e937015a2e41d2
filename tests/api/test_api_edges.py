"""Edges of the API found by an audit: a failure after the commit is reported as what it is; a tag
folder moved to another disk and linked back is still a tag; user_content that weights-only loading
rejects is flagged at save time; the unexpected-keys hint names the API's own switch."""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import smpckpt.storage.backends._nofollow as nofollow_mod
from smpckpt import (
    Checkpointer,
    CheckpointError,
    LayoutMismatch,
    UnsafeCheckpoint,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.catalog.root import scan_root
from smpckpt.storage import MANIFEST_NAME


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _assert_resumes(root: str, tag: str | None, want: nn.Module) -> None:
    got = _model(99)
    resume_from_checkpoint(root, tag, model=got)
    for k, v in want.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failure_after_the_commit_says_the_checkpoint_is_committed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    """The folder's fsync after the manifest's link/rename fails: the save must not be reported as a
    plain failure (a retry would then meet ``CheckpointExists``) but as committed and not confirmed
    durable; ``newest`` stays on the last save that completed."""
    root = str(tmp_path)
    save_checkpoint(root, "a", model=_model(0))
    tag = "a" if overwrite else "b"
    real = os.fsync
    before = open(os.path.join(root, "a_partial", MANIFEST_NAME), "rb").read()

    def failing(fd: int) -> None:
        # the folder's own descriptor (the commit fsyncs it after linking the manifest), read back by name
        path = os.readlink(f"/proc/self/fd/{fd}")
        manifest = os.path.join(path, MANIFEST_NAME)
        if path.endswith(f"{tag}_partial") and os.path.exists(manifest) and open(manifest, "rb").read() != before:
            raise OSError(5, "injected EIO")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    new = _model(1)
    with pytest.raises(CheckpointError, match=r"_partial is committed \(its manifest is in place.*injected EIO"):
        save_checkpoint(root, tag, model=new, overwrite=overwrite)
    monkeypatch.setattr(os, "fsync", real)
    assert open(os.path.join(root, "newest")).read().strip() == "a"
    _assert_resumes(root, tag, new)


def test_a_temp_name_left_behind_is_not_a_failed_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's temporary name cannot be removed after the link: the save succeeded, a warning
    names the leftover file."""
    root = str(tmp_path)
    real = os.unlink
    left: list[str] = []

    def failing(path: Any, *args: Any, **kw: Any) -> None:
        if f"{MANIFEST_NAME}.tmp." in str(path):
            left.append(str(path))
            raise PermissionError(13, "injected", str(path))
        real(path, *args, **kw)

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(nofollow_mod.__name__).addHandler(handler)  # drop_temp's
    monkeypatch.setattr(os, "unlink", failing)
    m = _model(2)
    try:
        save_checkpoint(root, "a", model=m)
    finally:
        monkeypatch.setattr(os, "unlink", real)
        logging.getLogger(nofollow_mod.__name__).removeHandler(handler)
    assert left and any(left[0] in msg for msg in seen), seen
    assert open(os.path.join(root, "newest")).read().strip() == "a"
    _assert_resumes(root, None, m)


def test_a_tag_folder_linked_from_another_disk(tmp_path: Any) -> None:
    """A tag folder moved elsewhere and symlinked back is listed and taken by a tag-less resume.
    Retention removes the link only: what it points at may be another root's checkpoint."""
    root, elsewhere = str(tmp_path / "root"), str(tmp_path / "other")
    os.makedirs(elsewhere)
    save_checkpoint(root, "a", model=_model(0))
    b = _model(1)
    save_checkpoint(root, "b", model=b)
    shutil.move(os.path.join(root, "b_partial"), os.path.join(elsewhere, "b_partial"))
    os.symlink(os.path.join(elsewhere, "b_partial"), os.path.join(root, "b_partial"))
    assert [(r.tag, r.state) for r in scan_root(root)] == [("a", "committed"), ("b", "committed")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: newest names b, and b is a committed tag
        _assert_resumes(root, None, b)
    assert last_resume_info().tag == "b"
    for tag in ("c", "d"):
        save_checkpoint(root, tag, model=_model(3), num_kept_partial_checkpoints=2)
    assert sorted(os.listdir(root)) == ["c_partial", "d_partial", "newest"]
    assert os.listdir(elsewhere) == ["b_partial"]
    _assert_resumes(elsewhere, "b", b)  # the target is still a committed checkpoint


def test_a_full_artifact_in_a_partial_folder_is_no_partial_checkpoint(tmp_path: Any) -> None:
    """An export written to `ROOT/<x>_partial` (export's out=, or `smpckpt consolidate ROOT/a ROOT/x_partial`)
    was listed as a committed partial checkpoint numbered after the others: a tag-less resume loaded the
    export, and retention would have removed it. It is listed as unsafe, skipped and kept."""
    root = str(tmp_path)
    a = _model(0)
    save_checkpoint(root, "a", model=a)
    save_checkpoint(root, "full", model=_model(1), partial=False)
    shutil.move(os.path.join(root, "full"), os.path.join(root, "x_partial"))
    assert [(r.tag, r.state) for r in scan_root(root)] == [("x", "unsafe"), ("a", "committed")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # newest names a, and nothing committed after it
        _assert_resumes(root, None, a)
    for tag in ("b", "c"):
        save_checkpoint(root, tag, model=_model(3), num_kept_partial_checkpoints=1)
    assert sorted(os.listdir(root)) == ["c_partial", "newest", "x_partial"]


@pytest.mark.parametrize("content", [b"", {"k": b""}, frozenset({1})], ids=["empty-bytes", "nested", "frozenset"])
def test_user_content_weights_only_rejects_is_flagged_at_save(tmp_path: Any, content: Any) -> None:
    """torch's weights-only allow-list refuses these (a type walk had called them safe): the save warns,
    a default resume refuses with UnsafeCheckpoint, allow_pickle=True gives the value back. The warning
    names the caller's line (it named a line of smpckpt's own: one frame short)."""
    said = "user_content holds objects weights-only loading rejects"
    for partial in (True, False):
        tag = f"p{int(partial)}"
        with pytest.warns(UserWarning, match=said) as warned:
            save_checkpoint(str(tmp_path), tag, model=_model(0), user_content=content, partial=partial)
        assert [w.filename for w in warned if said in str(w.message)] == [__file__]
        with pytest.raises(UnsafeCheckpoint):
            resume_from_checkpoint(str(tmp_path), tag, model=_model(1), partial=partial)
        assert (
            resume_from_checkpoint(str(tmp_path), tag, model=_model(1), partial=partial, allow_pickle=True) == content
        )
    with Checkpointer(str(tmp_path)) as ck, pytest.warns(UserWarning, match=said) as warned:
        ck.save("c", _model(0), user_content=content)
        ck.export("e", model=_model(0), user_content=content)
    assert [w.filename for w in warned if said in str(w.message)] == [__file__] * 2


@pytest.mark.parametrize("where", ["durable", "fast", "old"])
def test_user_content_needing_pickle_is_refused_before_the_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A resume without allow_pickle of a checkpoint whose user_content needs it is refused before the load
    (it was refused at the decode, after the load had overwritten the model), from the fast tier too. A
    checkpoint saved before the manifest recorded that ("old") is still refused, after the load, and loads
    with allow_pickle=True."""
    import smpckpt.api._save as save_mod

    root, node = str(tmp_path / "run"), str(tmp_path / "node")
    fast: dict[str, Any] = {"local_path": node, "replicas": 1, "durable_every": 2} if where == "fast" else {}
    tier = {"local_path": node} if fast else {}
    if where == "old":  # the manifest as saves before the flag wrote it
        real = save_mod.describe_user_content
        monkeypatch.setattr(save_mod, "describe_user_content", lambda u, pickled: real(u, False))
    saved = _model(0)
    with pytest.warns(UserWarning, match="resuming it will need allow_pickle=True"):
        save_checkpoint(root, "a", model=saved, user_content={"s": frozenset({1})}, **fast)
    wait_for_saves()
    got = _model(1)
    before = {k: v.clone() for k, v in got.state_dict().items()}
    said = f"checkpoint 'a' ({node if fast else root}" if where != "old" else "user_content needs arbitrary code"
    with pytest.raises(UnsafeCheckpoint, match="(?s)" + re.escape(said) + r".*allow_pickle=True only if you trust"):
        resume_from_checkpoint(root, model=got, **tier)
    loaded = {k: torch.equal(v, before[k]) for k, v in got.state_dict().items()}
    assert all(loaded.values()) if where != "old" else not any(loaded.values())
    got = _model(1)
    assert resume_from_checkpoint(root, model=got, allow_pickle=True, **tier) == {"s": frozenset({1})}
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in got.state_dict().items())


def test_safe_user_content_saves_without_a_warning(tmp_path: Any) -> None:
    content = {"step": 3, "b": b"x", "s": {1, 2}, "t": torch.arange(3), "nested": [(1.5, "a")]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_checkpoint(str(tmp_path), "a", model=_model(0), user_content=content)
    got = resume_from_checkpoint(str(tmp_path), "a", model=_model(1))
    assert torch.equal(got.pop("t"), content["t"]) and got == {k: v for k, v in content.items() if k != "t"}


def test_unexpected_keys_hint_names_strict_false(tmp_path: Any) -> None:
    big = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2), nn.Linear(2, 2))
    save_checkpoint(str(tmp_path), "a", model=big)
    with pytest.raises(LayoutMismatch, match=r"loaded by no rank: .*strict=False to resume_from_checkpoint"):
        resume_from_checkpoint(str(tmp_path), "a", model=_model(0))
    got = _model(0)
    resume_from_checkpoint(str(tmp_path), "a", model=got, strict=False)
    for k, v in got.state_dict().items():  # the keys both have, from the checkpoint, bit-exact
        assert torch.equal(v, big.state_dict()[k]), k


def test_a_save_into_a_partly_removed_folder_finishes_the_removal_first(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention interrupted on ``s1`` left its removal marker and old data files. Saving ``s1`` again
    must finish that removal before writing: a prune running meanwhile (it finishes partly removed
    folders) deleted the running save's folder, and the old files outlived the new commit."""
    from smpckpt.storage import FsspecStorageWriter, verify_checkpoint
    from smpckpt.storage.format.manifest import REMOVING_NAME
    from smpckpt.tools.cli import main

    root = str(tmp_path)
    save_checkpoint(root, "s0", model=_model(0))
    save_checkpoint(root, "s1", model=_model(1))
    folder = os.path.join(root, "s1_partial")
    old_files = set(os.listdir(folder)) - {MANIFEST_NAME, ".metadata"}
    with open(os.path.join(folder, REMOVING_NAME), "w") as f:  # remove_checkpoint's first two steps
        f.write("removing\n")
    os.remove(os.path.join(folder, MANIFEST_NAME))
    real = FsspecStorageWriter.write_data
    pruned: list[int] = []

    def write_while_pruning(self: Any, plan: Any, planner: Any) -> Any:
        pruned.append(main(["prune", root, "--keep", "10"]))
        return real(self, plan, planner)

    monkeypatch.setattr(FsspecStorageWriter, "write_data", write_while_pruning)
    new = _model(2)
    save_checkpoint(root, "s1", model=new)
    assert pruned == [0]
    assert not (old_files & set(os.listdir(folder))) and REMOVING_NAME not in os.listdir(folder)
    assert verify_checkpoint(folder).ok
    _assert_resumes(root, "s1", new)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_export_dtype_keeps_optimizer_step_counters(tmp_path: Any, dtype: torch.dtype) -> None:
    """``dtype=`` casts weights and moments, not scalars such as Adam's step counter: fp16 stored step
    70,001 as inf, bf16 stored 1,001 as 1,000, and the resumed optimizer applied the wrong bias correction."""
    m = _model(0)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    for st in opt.state.values():
        st["step"].fill_(70001 if dtype == torch.float16 else 1001)
    save_checkpoint(str(tmp_path), "f", model=m, optimizer=opt, partial=False, dtype=dtype, include_optimizer=True)
    m2 = _model(1)
    opt2 = torch.optim.Adam(m2.parameters())
    m2(torch.randn(2, 4)).sum().backward()
    opt2.step()
    resume_from_checkpoint(str(tmp_path), "f", model=m2, optimizer=opt2, partial=False, allow_dtype_cast=True)
    steps = [st["step"] for st in opt2.state.values()]
    assert steps and all(torch.equal(s, torch.tensor(70001.0 if dtype == torch.float16 else 1001.0)) for s in steps)
    exp = [v for st in opt2.state.values() for k, v in st.items() if k == "exp_avg"]
    assert len(exp) == len(opt.state) and all(
        torch.equal(a, b["exp_avg"].to(dtype).float()) for a, b in zip(exp, opt.state.values())
    )


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("strict", [True, False])
def test_a_one_element_tensor_into_a_0_d_destination_is_refused_by_name(
    tmp_path: Any, partial: bool, strict: bool
) -> None:
    """A parameter saved as ``[1]`` and resumed as a 0-d one (or the reverse, refused already) is a shape
    change like any other: the planner took ``()`` for "no view recorded", so a 0-d destination passed
    for one whose save view was being undone, and ``[1]`` loaded into it silently, strict or not."""
    saved, dest = nn.Module(), nn.Module()
    saved.s = nn.Parameter(torch.full((1,), 7.0))
    dest.s = nn.Parameter(torch.tensor(-1.0))
    save_checkpoint(str(tmp_path), "t", model=saved, partial=partial)
    with pytest.raises(LayoutMismatch, match=r"s: the checkpoint holds global shape \(1,\) but .* implies \(\)"):
        resume_from_checkpoint(str(tmp_path), "t", model=dest, partial=partial, strict=strict)
    assert torch.equal(dest.s.detach(), torch.tensor(-1.0))


@pytest.mark.parametrize("as_number", [int, float])
def test_a_step_saved_as_a_python_number_resumes_into_a_tensor_step(tmp_path: Any, as_number: type) -> None:
    """Adam's ``step`` saved as a Python number (older torch, custom optimizers) resumes into torch 2.x's
    0-d tensor step: an exact conversion (the next ``step()`` equals torch's ``load_state_dict``); a value
    the destination's dtype cannot hold exactly is refused naming the key, or cast with allow_dtype_cast."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for _ in range(3):
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    for s in opt.state.values():
        s["step"] = as_number(s["step"].item())
    save_checkpoint(str(tmp_path), "s", model=m, optimizer=opt)
    m2, m3 = nn.Linear(3, 2), copy.deepcopy(m)
    opt2, opt3 = torch.optim.Adam(m2.parameters(), lr=0.1), torch.optim.Adam(m3.parameters(), lr=0.1)
    resume_from_checkpoint(str(tmp_path), "s", model=m2, optimizer=opt2)
    opt3.load_state_dict(opt.state_dict())
    assert all(torch.equal(s["step"], torch.tensor(3.0)) for s in opt2.state.values())
    x = torch.randn(4, 3)
    for mm, oo in ((m2, opt2), (m3, opt3)):
        mm(x).sum().backward()
        oo.step()
    assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), m3.parameters()))
    for s in opt.state.values():
        s["step"] = as_number(2**24 + 1)  # no float32 holds it
    save_checkpoint(str(tmp_path), "big", model=m, optimizer=opt)
    with pytest.raises(LayoutMismatch, match=r"optim\.state\.\S*step: the checkpoint holds the number 16777217"):
        resume_from_checkpoint(str(tmp_path), "big", model=m2, optimizer=opt2)
    resume_from_checkpoint(str(tmp_path), "big", model=m2, optimizer=opt2, allow_dtype_cast=True)
    assert all(torch.equal(s["step"], torch.tensor(2**24 + 1).float()) for s in opt2.state.values())
    for s in opt.state.values():  # rev61g F1: past what any dtype holds, torch's own error named no key
        s["step"] = as_number(2**70) if as_number is int else float("inf")
    save_checkpoint(str(tmp_path), "huge", model=m, optimizer=opt)
    m4, huge = nn.Linear(3, 2), 2**70 if as_number is int else float("inf")
    opt4 = torch.optim.Adam(m4.parameters(), lr=0.1, capturable=False)
    m4(torch.randn(4, 3)).sum().backward()
    opt4.step()
    for s in opt4.state.values():
        s["step"] = torch.tensor(0, dtype=torch.int64)  # an int64 step: 2**70 and inf are refused by key
    with pytest.raises(LayoutMismatch, match=rf"optim\.state\.\S*step: the checkpoint holds the number {huge!r}"):
        resume_from_checkpoint(str(tmp_path), "huge", model=m4, optimizer=opt4, allow_dtype_cast=as_number is int)


def test_strict_refusals_hint_at_a_scheduler_and_at_unflattened_optimizer_state(tmp_path: Any) -> None:
    """strict=True lists the keys; it also names the two common causes when they match: a scheduler's
    ``initial_lr`` (built before the resume but not before the save) and optimizer state saved unflattened by
    stock DCP (param groups as a list)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_checkpoint(str(tmp_path), "s", model=m, optimizer=opt)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to the param groups
    with pytest.raises(LayoutMismatch, match=r"param_groups\.weight\.initial_lr.*LR scheduler adds initial_lr"):
        resume_from_checkpoint(str(tmp_path), "s", model=m, optimizer=opt)
    save_checkpoint(str(tmp_path), "t", model=m, optimizer=opt)  # and the reverse: saved with initial_lr
    with pytest.raises(LayoutMismatch, match=r"loaded by no rank: .*initial_lr.*LR scheduler adds initial_lr"):
        resume_from_checkpoint(str(tmp_path), "t", model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1))
    msd, osd = get_state_dict(m, opt)  # DCP's default: param groups a list, not flattened
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "stock_partial"), no_dist=True)
    with pytest.raises(LayoutMismatch, match=r"param_groups\.weight\.lr.*flatten_optimizer_state_dict=True"):
        resume_from_checkpoint(str(tmp_path), "stock", model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"strict=False skipped keys; .*flatten_optimizer_state_dict=True"):
        resume_from_checkpoint(str(tmp_path), "stock", model=m, optimizer=opt, strict=False)


class _IntStepSGD(torch.optim.SGD):
    """A custom optimizer keeping its ``step`` as a Python int (as some do, e.g. Hugging Face's Adafactor)."""

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
        return loss


def test_a_tensor_step_resumes_into_a_python_number_step(tmp_path: Any) -> None:
    """A 0-d tensor ``step`` saved where the live optimizer holds a Python number resumes as a number of the
    live type when exact (a float64 7.0 into an int step); 7.5 into an int is refused naming the key, and
    cast with allow_dtype_cast."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = _IntStepSGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    for s in opt.state.values():
        s["step"] = torch.tensor(7.0, dtype=torch.float64)
    save_checkpoint(str(tmp_path), "s", model=m, optimizer=opt)
    m2 = copy.deepcopy(m)
    opt2 = _IntStepSGD(m2.parameters(), lr=0.1, momentum=0.9)
    m2(torch.randn(4, 3)).sum().backward()
    opt2.step()
    resume_from_checkpoint(str(tmp_path), "s", model=m2, optimizer=opt2)
    steps = [s["step"] for s in opt2.state.values()]
    assert steps == [7, 7] and all(type(s) is int for s in steps)
    assert all(
        torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
        for p, q in zip(m.parameters(), m2.parameters())
    )
    for s in opt.state.values():
        s["step"] = torch.tensor(7.5, dtype=torch.float64)
    save_checkpoint(str(tmp_path), "half", model=m, optimizer=opt)
    with pytest.raises(
        LayoutMismatch, match=r"optim\.state\.\S*step: the checkpoint holds a torch\.float64 0-d tensor 7\.5"
    ):
        resume_from_checkpoint(str(tmp_path), "half", model=m2, optimizer=opt2)
    resume_from_checkpoint(str(tmp_path), "half", model=m2, optimizer=opt2, allow_dtype_cast=True)
    assert [s["step"] for s in opt2.state.values()] == [7, 7]


@pytest.mark.parametrize("partial", [True, False])
def test_a_save_from_a_signal_handler_during_a_resume_is_refused_by_name(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, partial: bool
) -> None:
    """A preempted restart (hunt66d): SIGTERM lands while the resume is loading in place; the handler's
    emergency save would commit half-loaded state as `newest`, resumed silently by the next restart; its full
    save (smp's `partial=False`, an export) committed a half-loaded artifact (rev66f F1)."""
    import signal

    from smpckpt.planners import ParallelLoadPlanner

    torch.manual_seed(0)
    m, m2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    save_checkpoint(str(tmp_path), "s2", model=m)
    refused: list[BaseException] = []

    def handler(signum: int, frame: Any) -> None:
        with pytest.raises(CheckpointError) as err:
            save_checkpoint(str(tmp_path), "emerg", model=m2, partial=partial)
        refused.append(err.value)

    orig = ParallelLoadPlanner.commit_tensor

    def commit_then_signal(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        orig(self, read_item, tensor)
        if not refused:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ParallelLoadPlanner, "commit_tensor", commit_then_signal)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        resume_from_checkpoint(str(tmp_path), model=m2)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert refused and "'emerg'" in str(refused[0]) and "while resuming" in str(refused[0]), refused
    assert sorted(os.listdir(tmp_path)) == ["newest", "s2_partial"]
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


@pytest.mark.dist
@pytest.mark.parametrize(
    ("world", "savers", "missing", "asy"),
    [(2, (1,), "rank 0", False), (2, (0,), "rank 1", False), (3, (0, 1), "rank 2", False), (2, (1,), "rank 0", True)],
)
def test_a_save_that_only_some_ranks_enter_fails_within_the_join_timeout_naming_the_others(
    tmp_path: Any, world: int, savers: tuple[int, ...], missing: str, asy: bool
) -> None:
    """hunt66d P2: a save made by some ranks only (a SIGTERM handler's, a flag only one rank checks) met the
    other ranks inside their training collective: every rank hung with no message until the group's
    timeout (30 minutes). The save now first meets on a gloo group of its own, bounded by
    ``Sharding.join_timeout``: each saver fails in about that time, naming the ranks that did not join
    (rank 0 knows; another rank of a larger world knows rank 0 did not confirm), nothing is written, 's1'
    stays newest and resumes bit-exactly, and the savers can still meet the others in their collective. ``asy``:
    the saver's close() after it returns at once (rev67d F2: it hung in a barrier of the async group), the other
    rank's within the bound (rev67f F1: it hung there, waiting for the saver)."""
    import api_workers
    from dist_harness import run_world

    got = run_world(api_workers.lone_save_world, world, str(tmp_path), savers, asy, timeout=90)
    for rank, r in enumerate(got):
        assert r["newest"] == "s1" and r["dirs"] == ["s1_partial"] and r["exact"], (rank, r)
        if rank not in savers:
            assert r["said"] == "no error" and r["closed"] < 20, r
            continue
        assert r["said"].startswith(f"rank {rank} of {world}: saving checkpoint 'emerg' under "), r
        assert "within 3s (Sharding.join_timeout)" in r["said"] and "README" in r["said"], r
        assert 2.5 < r["took"] < 30, r
        assert "refused" in r["again"] and "'again'" in r["again"], r
    assert f"{missing} did not enter the save" in got[savers[0]]["said"], got
    if world == 3:
        assert "rank 0 did not confirm" in got[1]["said"], got[1]


@pytest.mark.dist
@pytest.mark.parametrize(("world", "late"), [(2, 0), (3, 1)])
def test_a_rank_entering_a_save_after_the_join_timeout_is_told_the_others_may_have_given_up(
    tmp_path: Any, world: int, late: int
) -> None:
    """rev67d F3: the late rank was told another rank "died or was killed", and its later refusals named the
    others as not having entered the save; it now says one died or they gave up after join_timeout."""
    import api_workers
    from dist_harness import run_world

    got = run_world(api_workers.late_save_world, world, str(tmp_path), late, timeout=90)
    said = got[late]
    assert said["b"].startswith(f"rank {late} of {world}: saving checkpoint 'b' under "), said
    assert "or they gave up after join_timeout (2s; this rank entered late)" in said["b"], said
    assert "did not enter" not in said["b"] + said["again"], said
    assert "'again'" in said["again"] and "refused" in said["again"] and "entered late" in said["again"], said
    assert all("did not" in r["b"] for i, r in enumerate(got) if i != late), got


@pytest.mark.dist
@pytest.mark.parametrize("asy", [False, True])
def test_an_smp_save_argument_failing_on_one_rank_while_the_kept_checkpointer_is_replaced_fails_every_rank(
    tmp_path: Any, asy: bool
) -> None:
    # rev67d F1: with join_timeout set, the failing rank met in the kept Checkpointer's join, the others in a new
    # one's agreement: rank 1 failed after the bound, rank 0 hung
    import api_workers
    from dist_harness import run_world

    got = run_world(api_workers.smp_rebuild_world, 2, str(tmp_path), asy, timeout=60)
    assert got[1]["said"] == "partial must be True or False, got 'yes'", got
    assert got[0]["said"] == "rank 1 failed: partial must be True or False, got 'yes'", got
    assert all(r["took"] < 2.5 for r in got), got


@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), float("inf"), True, "60"])
def test_a_join_timeout_that_is_no_positive_number_of_seconds_is_refused_when_built(bad: Any) -> None:
    from smpckpt import Sharding

    with pytest.raises(
        ValueError, match=re.escape(f"join_timeout must be a positive number of seconds or None, got {bad!r}")
    ):
        Sharding(join_timeout=bad)
    assert Sharding(join_timeout=None).join_timeout is None and Sharding(join_timeout=0.5).join_timeout == 0.5
    assert Sharding().join_timeout is None


def test_held_by_some_holding_a_non_string_is_refused_by_name_when_built() -> None:
    # rev73d 2: Sharding(held_by_some=[1]) was built, and the save failed later with "spec rule keys are glob
    # strings, got int 1", naming no option
    from smpckpt import Sharding

    for bad in ([1], ("experts.*", None), 3):
        with pytest.raises(TypeError, match=re.escape(f"held_by_some must be a list of key globs (str), got {bad!r}")):
            Sharding(held_by_some=bad)
    with pytest.raises(TypeError, match=r"held_by_some must be a list of globs, not a single string"):
        Sharding(held_by_some="experts.*")
    assert Sharding(held_by_some=["experts.*"]).held_by_some == ("experts.*",)
