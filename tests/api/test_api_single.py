"""Single process, no process group: save/resume, validation, strictness, user_content safety."""

from __future__ import annotations

import copy
import os
import random
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from unused_branch import unused_branch_model, unused_branch_step

import smpckpt
from smpckpt import (
    CheckpointExists,
    CheckpointNotFound,
    LayoutMismatch,
    UnsafeCheckpoint,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
)
from smpckpt.catalog.root import validate_tag
from smpckpt.storage import FsspecStorageWriter


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    o.zero_grad()
    m(torch.randn(5, 4)).sum().backward()
    o.step()
    return m, o


def _equal(a: nn.Module, b: nn.Module) -> bool:
    """Same (non-empty) set of state keys, and every value bit-exact with the same dtype and shape."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa and list(sa) == list(sb), (list(sa), list(sb))
    return all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def _assert_optim_equal(m: nn.Module, o: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer) -> None:
    """Per parameter (matched by name), the same non-empty optimizer state keys with bit-exact values."""
    p1, p2 = dict(m.named_parameters()), dict(m2.named_parameters())
    assert p1 and list(p1) == list(p2)
    for name in p1:
        s1, s2 = o.state[p1[name]], o2.state[p2[name]]
        assert s1 and set(s1) == set(s2), (name, set(s1), set(s2))
        for k in s1:
            assert torch.equal(s1[k], s2[k]), (name, k)


def test_round_trip_no_process_group(tmp_path: Any) -> None:
    m, o = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o, user_content={"step": 7, "t": torch.arange(3)})
    expect_torch, expect_py = torch.rand(2), random.random()
    assert sorted(os.listdir(tmp_path)) == ["a_partial", "newest"]
    assert (tmp_path / "newest").read_text().strip() == "a"
    m2, o2 = _model(1)
    uc = resume_from_checkpoint(str(tmp_path), model=m2, optimizer=o2)
    assert uc["step"] == 7 and torch.equal(uc["t"], torch.arange(3))
    assert torch.equal(torch.rand(2), expect_torch) and random.random() == expect_py
    assert _equal(m, m2)
    _assert_optim_equal(m, o, m2, o2)
    assert not _equal(m, _model(1)[0])  # the comparison can fail: a fresh model differs
    info = last_resume_info()
    assert info is not None and info.path_taken == "fast" and not info.layout_changed and info.tag == "a"


def test_partial_false_full_checkpoint_round_trip(tmp_path: Any) -> None:
    m, _ = _model(0)
    with pytest.raises(CheckpointNotFound):
        resume_from_checkpoint(str(tmp_path), partial=False, model=m)
    with pytest.raises(TypeError, match="partial must be True or False"):
        save_checkpoint(str(tmp_path), "a", partial="no", model=m)
    assert not os.listdir(tmp_path)
    save_checkpoint(str(tmp_path), "a", partial=False, model=m, user_content={"step": 3})
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no newest, no _partial folder
    fresh, _ = _model(1)
    assert resume_from_checkpoint(str(tmp_path), "a", partial=False, model=fresh) == {"step": 3}
    for (k, v), w in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k


def test_full_resume_into_a_compiled_model_loads_under_strict(tmp_path: Any) -> None:
    """rev62d F4: a full artifact resumed without optimizer into a ``torch.compile``-wrapped model loads its
    inner module's keys under ``strict=True`` (the wrapper's ``_orig_mod.`` prefix is not a missing key)."""
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", partial=False, model=m)
    for strict in (True, False):
        fresh, _ = _model(1)
        compiled = torch.compile(fresh)
        resume_from_checkpoint(str(tmp_path), "a", partial=False, model=compiled, strict=strict)
        for (k, v), w in zip(m.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(v, w), (strict, k)


_NOT_POSITIVE = "num_kept_partial_checkpoints must be >= 1 (it counts the checkpoints kept, the new one included), got "
_NOT_INT = "num_kept_partial_checkpoints must be a positive int or None, got "


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (0, _NOT_POSITIVE + "0"),
        (-1, _NOT_POSITIVE + "-1"),
        (True, _NOT_INT + "True"),
        (1.5, _NOT_INT + "1.5"),
        ("2", _NOT_INT + "'2'"),
    ],
)
def test_bad_retention_count_rejected_up_front(tmp_path: Any, keep: Any, message: str) -> None:
    m, _ = _model(0)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        save_checkpoint(str(tmp_path), "a", model=m, num_kept_partial_checkpoints=keep)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "tag",
    [
        "",
        "a/b",
        "..",
        "a..b",
        "x\x00",
        "tab\tbed",
        "new\nline",
        " pad",
        "\x7f",
        "a\\b",
        # glob characters (fsspec backends expand them), a reserved suffix, a leading dot or dash, too long
        "x*",
        "p[12]",
        "a?",
        "{a,b}",
        "!x",
        "x_partial",
        ".hidden",
        "-rf",
        "é" * 101,
    ],
)
def test_bad_tags_rejected(tmp_path: Any, tag: str) -> None:
    m, _ = _model(0)
    # the message names the tag (repr of its first 80 characters) and says why
    prefix = f"^invalid checkpoint tag {re.escape(repr(tag[:80]))}: it "
    with pytest.raises(ValueError, match=prefix):
        save_checkpoint(str(tmp_path), tag, model=m)
    with pytest.raises(ValueError, match=prefix):
        resume_from_checkpoint(str(tmp_path), tag=tag, model=m)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("tag", ["step_10", "total_steps1000", "v1.2", "ep-3+lr=1e-4", "ü", "é" * 100, "a_partial1"])
def test_good_tags(tag: str) -> None:
    assert validate_tag(tag) == tag


def test_non_str_tag_rejected(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="^checkpoint tag must be a str, got int$"):
        save_checkpoint(str(tmp_path), 5, model=_model(0)[0])  # type: ignore[arg-type]


def test_nothing_committed(tmp_path: Any) -> None:
    m, _ = _model(0)
    with pytest.raises(CheckpointNotFound, match=f"^no committed checkpoint under {re.escape(str(tmp_path))}$"):
        resume_from_checkpoint(str(tmp_path), model=m)
    assert resume_from_checkpoint(str(tmp_path), model=m, missing_ok=True) is None
    with pytest.raises(CheckpointNotFound, match=f"^no checkpoint 'nope' under {re.escape(str(tmp_path))}$"):
        resume_from_checkpoint(str(tmp_path), tag="nope", model=m)


@pytest.mark.parametrize("damage", ["corrupt", "unreadable", "uncommitted"])
def test_a_damaged_only_checkpoint_is_no_fresh_start(tmp_path: Any, damage: str) -> None:
    """``newest`` names the job's only checkpoint (Retention keep=1), whose manifest is damaged, unreadable
    (an I/O error) or gone (a copy still syncing): a tag-less resume with missing_ok=True returned None and
    the job trained from scratch, with only a log line; without missing_ok it said "no committed
    checkpoint". Refused, naming the tag and what is wrong with it."""
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m, num_kept_partial_checkpoints=1)
    save_checkpoint(str(tmp_path), "b", model=m, num_kept_partial_checkpoints=1)
    manifest = tmp_path / "b_partial" / "smpckpt.manifest.json"
    if damage == "corrupt":
        manifest.write_bytes(manifest.read_bytes()[:10])
    else:
        manifest.unlink()
        if damage == "unreadable":
            manifest.mkdir()  # reading it fails with an OSError
    error = smpckpt.CheckpointError if damage == "unreadable" else smpckpt.CheckpointCorrupt
    for missing_ok in (True, False):
        with pytest.raises(error, match=f"newest names 'b', which is {damage} .* not starting fresh"):
            resume_from_checkpoint(str(tmp_path), model=_model(1)[0], missing_ok=missing_ok)
    (tmp_path / "newest").unlink()  # the user removed it on purpose: nothing names the folder
    assert resume_from_checkpoint(str(tmp_path), model=m, missing_ok=True) is None


def test_overwrite(tmp_path: Any) -> None:
    m, o = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m, user_content=1)
    folder = re.escape(str(tmp_path / "a_partial"))
    with pytest.raises(CheckpointExists, match=f"{folder} already holds a committed checkpoint; pass overwrite=True"):
        save_checkpoint(str(tmp_path), "a", model=m, user_content=2)
    assert resume_from_checkpoint(str(tmp_path), model=m) == 1  # the refused save changed nothing
    save_checkpoint(str(tmp_path), "a", model=m, user_content=3, overwrite=True)
    assert resume_from_checkpoint(str(tmp_path), model=m) == 3


def test_an_overwrite_of_an_older_tag_is_the_newest_save_for_a_tagless_resume_and_retention(tmp_path: Any) -> None:
    """Ordered by its new sequence number, not its tag's first: a tag-less resume loads it without falling back to
    the tag saved after its first generation, and retention removes that tag, not the overwritten one (hunt72a)."""
    root = str(tmp_path)
    kept = smpckpt.Retention(num_kept_partial_checkpoints=2)
    with smpckpt.Checkpointer(root, retention=kept) as ckpt:
        ckpt.save("a", model=_model(0)[0])
        ckpt.save("b", model=_model(1)[0])
        m, _ = _model(2)
        ckpt.save("a", model=m, options=smpckpt.SaveOptions(overwrite=True))
    m2, _ = _model(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: 'newest' names the newest save
        with smpckpt.Checkpointer(root) as restarted:
            restarted.resume(model=m2)
    assert _equal(m, m2) and restarted.last_resume_info is not None and not restarted.last_resume_info.fell_back
    with smpckpt.Checkpointer(root, retention=kept) as ckpt:
        ckpt.resume(model=_model(6)[0])
        ckpt.save("c", model=_model(3)[0])
    assert sorted(os.listdir(root)) == ["a_partial", "c_partial", "newest"]
    m3, _ = _model(7)
    resume_from_checkpoint(root, tag="a", model=m3)
    assert _equal(m, m3)


def test_explicit_tag_and_crash_between_write_and_commit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = _model(0)
    save_checkpoint(str(tmp_path), "good", model=m, optimizer=o, user_content="good")
    m_bad, o_bad = _model(3)

    def crash(self: Any, data: bytes) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(FsspecStorageWriter, "_write_manifest", crash)
    monkeypatch.setattr(FsspecStorageWriter, "discard_failed_save", lambda self: [])  # a crash cleans nothing up
    with pytest.raises(smpckpt.CheckpointError, match="power cut") as excinfo:
        save_checkpoint(str(tmp_path), "bad", model=m_bad, optimizer=o_bad, user_content="bad")
    assert excinfo.value.__cause__ is not None  # DCP's CheckpointException
    monkeypatch.undo()
    assert (tmp_path / "newest").read_text().strip() == "good"
    with pytest.raises(CheckpointNotFound, match="no commit marker"):
        resume_from_checkpoint(str(tmp_path), tag="bad", model=m_bad)
    (tmp_path / "newest").write_text("bad\n")  # e.g. a newest synced ahead of its checkpoint
    m2, o2 = _model(5)
    with pytest.warns(UserWarning, match="newest committed checkpoint 'good'"):
        assert resume_from_checkpoint(str(tmp_path), model=m2, optimizer=o2) == "good"
    assert _equal(m, m2) and last_resume_info().fell_back  # type: ignore[union-attr]


def test_strict_refuses_before_touching_the_model(tmp_path: Any) -> None:
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m)
    bigger = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(
        LayoutMismatch,  # the rank named once: the planner's own "rank 0: " prefix is not repeated
        match=re.escape("failed on rank 0: 2 keys are not in the checkpoint: model.3.weight, model.3.bias"),
    ):
        resume_from_checkpoint(str(tmp_path), model=bigger)
    assert all(torch.equal(before[k], v) for k, v in bigger.state_dict().items())
    resume_from_checkpoint(str(tmp_path), model=bigger, strict=False)
    assert "model.3.weight" in last_resume_info().skipped_keys  # type: ignore[union-attr]
    assert torch.equal(bigger[0].weight, m[0].weight)


def test_shape_mismatch_is_layout_mismatch(tmp_path: Any) -> None:
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m)
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    # both shapes and the key are named
    with pytest.raises(
        LayoutMismatch,
        match=re.escape("model.0.weight: the checkpoint holds global shape (3, 4) but rank 0's layout implies (5, 4)"),
    ):
        resume_from_checkpoint(str(tmp_path), model=other)


def test_model_only_resume_ignores_saved_optimizer(tmp_path: Any) -> None:
    m, o = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    m2, _ = _model(1)
    resume_from_checkpoint(str(tmp_path), model=m2)
    assert _equal(m, m2)
    with pytest.raises(
        ValueError, match="^optimizer state is keyed by the model's parameter names: pass model= with optimizer=$"
    ):
        resume_from_checkpoint(str(tmp_path), optimizer=o)


def test_translate_function(tmp_path: Any) -> None:
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m)
    seen: list[str] = []

    def translate(sd: dict[str, Any]) -> dict[str, Any]:
        seen.extend(sd)
        return {k: v * 2 for k, v in sd.items()}

    m2, _ = _model(1)
    resume_from_checkpoint(str(tmp_path), model=m2, translate_function=translate)
    assert "0.weight" in seen
    assert torch.equal(m2[0].weight, m[0].weight * 2)


def test_translate_function_moving_values_between_keys(tmp_path: Any) -> None:
    """The load lands in the model's own tensors, which the translated state is then copied into key by
    key: a translation that swaps two keys' values (or hands a key a transposed view of another) was
    applied from tensors already overwritten -- both layers ended with the second's weights, silently."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    save_checkpoint(str(tmp_path), "a", model=m)
    w0, w1, w2 = (layer.weight.detach().clone() for layer in m)

    def swap(sd: dict[str, Any]) -> dict[str, Any]:
        return {"0.weight": sd["1.weight"], "1.weight": sd["0.weight"], "2.weight": sd["2.weight"]}

    def own_transposed(sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "2.weight": sd["2.weight"].t()}

    def fresh() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))

    got = fresh()
    resume_from_checkpoint(str(tmp_path), model=got, translate_function=swap)  # was: silently w1, w1
    assert torch.equal(got[0].weight, w1)
    assert torch.equal(got[1].weight, w0)
    assert torch.equal(got[2].weight, w2)
    got = fresh()
    resume_from_checkpoint(str(tmp_path), model=got, translate_function=own_transposed)  # was: a RuntimeError
    assert torch.equal(got[2].weight, w2.t())


def test_translate_function_moving_values_between_keys_with_the_optimizer(tmp_path: Any) -> None:
    """hunt66c M1: resumed with the optimizer, a translate_function swapping two same-shape layers moved their
    weights while the optimizer state stayed by key: each layer took the other's Adam moments, silently. Now
    refused under strict, naming both keys (before anything is applied), and warned under strict=False."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(2, 4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)

    def swap(sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "0.weight": sd["2.weight"], "2.weight": sd["0.weight"]}

    m2 = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    before = copy.deepcopy(m2.state_dict())
    said = r"translate_function moved values between model keys \(2\.weight -> 0\.weight, 0\.weight -> 2\.weight\): "
    with pytest.raises(LayoutMismatch, match="^" + said):
        resume_from_checkpoint(
            str(tmp_path), "a", model=m2, optimizer=torch.optim.Adam(m2.parameters()), translate_function=swap
        )
    assert all(torch.equal(v, before[k]) for k, v in m2.state_dict().items())  # the model as it was
    with pytest.warns(UserWarning, match=said + ".*strict=False: loaded so"):
        resume_from_checkpoint(
            str(tmp_path),
            "a",
            model=m2,
            optimizer=torch.optim.Adam(m2.parameters()),
            translate_function=swap,
            strict=False,
        )
    assert torch.equal(m2[0].weight, m[2].weight) and torch.equal(m2[2].weight, m[0].weight)

    def swap_in_place(sd: dict[str, Any]) -> dict[str, Any]:  # rev66e F1: the dict it is given, changed
        sd["0.weight"], sd["2.weight"] = sd["2.weight"], sd["0.weight"]
        return sd

    with pytest.raises(LayoutMismatch, match="^" + said):
        resume_from_checkpoint(
            str(tmp_path), "a", model=m2, optimizer=torch.optim.Adam(m2.parameters()), translate_function=swap_in_place
        )


def test_translate_function_resumes_with_keys_skipped_and_buffers_moved(tmp_path: Any) -> None:
    """rev66e F0: under strict=False a key the checkpoint lacks kept uninitialised memory (the load's aside
    copy), not the model's value; F4: a buffer swap was refused as if it moved optimizer state."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(8, 4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    bias = m2[0].bias.detach().clone()

    def swap_buffers(sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "1.running_mean": sd["2.running_mean"], "2.running_mean": sd["1.running_mean"]}

    resume_from_checkpoint(
        str(tmp_path),
        "a",
        model=m2,
        optimizer=torch.optim.Adam(m2.parameters()),
        translate_function=swap_buffers,
        strict=False,
    )
    assert torch.equal(m2[0].bias, bias)  # not in the checkpoint: the model's own value
    assert torch.equal(m2[0].weight, m[0].weight) and torch.equal(m2[1].running_mean, m[2].running_mean)
    same = nn.Sequential(nn.Linear(4, 4, bias=False), nn.BatchNorm1d(4), nn.BatchNorm1d(4))  # strict: no refusal
    opt = torch.optim.Adam(same.parameters())
    resume_from_checkpoint(str(tmp_path), "a", model=same, optimizer=opt, translate_function=swap_buffers)
    assert torch.equal(same[2].running_mean, m[1].running_mean)


def _two(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 3)).sum().backward()
    o.step()
    return m, o


@pytest.mark.parametrize(
    ("how", "gone"),
    [
        ("drop", ["1.bias"]),
        ("rename", ["1.bias", "head.bias"]),
        ("add", ["extra"]),
    ],
)
def test_translate_function_keys_it_leaves_out_are_not_loaded(tmp_path: Any, how: str, gone: list[str]) -> None:
    """smp's meaning: the translated state dict is what the model loads. A key the function drops (or
    renames away) was loaded into the model anyway under strict=False (the load lands in the model's own
    tensors), and strict=True was torch's bare RuntimeError. Now strict=False keeps the model's value for
    it and lists it (and a key the model lacks) in ResumeInfo.skipped_keys; strict=True refuses naming them."""
    saved, so = _two(0)
    save_checkpoint(str(tmp_path), "a", model=saved, optimizer=so)
    want = {k: v.clone() for k, v in saved.state_dict().items()}

    def fn(sd: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in sd.items() if k != "1.bias" or how == "add"}
        if how == "rename":
            out["head.bias"] = sd["1.bias"]
        if how == "add":
            out["extra"] = torch.zeros(2)
        return out

    for strict in (True, False):
        got, go = _two(1)
        before = {k: v.clone() for k, v in got.state_dict().items()}
        kw: dict[str, Any] = dict(model=got, optimizer=go, translate_function=fn, strict=strict)
        if strict:
            said = "dropped 1.bias (the model holds them)" if how != "add" else "returned extra, which the model lacks"
            with pytest.raises(LayoutMismatch, match=r"^translate_function " + re.escape(said)):
                resume_from_checkpoint(str(tmp_path), **kw)
            assert all(torch.equal(v, before[k]) for k, v in got.state_dict().items())  # the model as it was
            if how == "rename":
                with pytest.raises(LayoutMismatch, match=re.escape("returned head.bias, which the model lacks")):
                    resume_from_checkpoint(str(tmp_path), **kw)
            continue
        resume_from_checkpoint(str(tmp_path), **kw)
        for k, v in got.state_dict().items():
            assert torch.equal(v, before[k] if k in gone else want[k]), k
        info = last_resume_info()
        assert info is not None and info.skipped_keys == tuple(f"model.{k}" for k in gone)


def test_the_skipped_keys_warning_made_an_error_fails_the_resume_before_anything_is_applied(tmp_path: Any) -> None:
    """rev61c F2: the warning came after the state was applied (RNG restored, the roll-back recorded); made
    an error (``-W error``) the caller saw a failed resume that had half happened. It now fails before the
    state is applied: the RNG is the caller's own, ``last_resume_info`` unset (the model's tensors, filled in
    place by the load, hold the checkpoint's values, as after any failed load). rev61c F3: a translate_function's dropped key is
    named as the function's, not as "not in the checkpoint"."""
    import warnings

    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    ckpt = smpckpt.Checkpointer(str(tmp_path))
    ckpt.save("s", m)
    torch.manual_seed(123)
    want = torch.rand(3)
    grown = nn.Linear(2, 2)
    grown.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"not in the checkpoint: model\.extra"):
            ckpt.resume("s", grown, options=smpckpt.ResumeOptions(strict=False))
    assert torch.equal(torch.rand(3), want)  # the checkpoint's RNG state was not restored
    assert ckpt.last_resume_info is None

    def drop_bias(sd: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in sd.items() if k != "bias"}

    with pytest.warns(UserWarning, match=r"left unloaded by the translate_function \(dropped.*\): model\.bias"):
        ckpt.resume("s", nn.Linear(2, 2), options=smpckpt.ResumeOptions(strict=False, translate_function=drop_bias))
    ckpt.close()


def test_strict_false_warns_naming_the_keys_it_skipped(tmp_path: Any) -> None:
    """A strict=False resume that skipped keys strict=True refuses said nothing (ResumeInfo.skipped_keys
    only): a stock ``dcp.save(model.state_dict())`` (no ``model.`` prefix) "resumed" loading no tensor, and
    optimizer state saved unflattened by stock DCP left the live learning rates in place. It warns naming
    them, as a full resume does; what strict=True accepts too (a parameter saved without state) is not said."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = _model(0)
    dcp.save(m.state_dict(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "flat_partial")), no_dist=True)
    got, _ = _model(1)
    with pytest.warns(
        UserWarning,
        match=r"flat_partial: strict=False skipped keys; not in the checkpoint: "
        r"model\.0\.bias, model\.0\.weight.*; in the checkpoint, loaded by no rank: 0\.bias, 0\.weight",
    ):
        smpckpt.Checkpointer(str(tmp_path)).resume("flat", got, options=smpckpt.ResumeOptions(strict=False))
    assert not torch.equal(got[0].weight, m[0].weight)  # nothing was loaded, as the warning says
    msd, osd = get_state_dict(m, o)  # DCP's default: param_groups a list, not keyed by parameter
    dcp.save(
        {"model": msd, "optim": osd},
        storage_writer=dcp.FileSystemWriter(str(tmp_path / "nested_partial")),
        no_dist=True,
    )
    got, go = _model(1)
    go.param_groups[0]["lr"] = 0.5
    with pytest.warns(
        UserWarning,
        match=r"not in the checkpoint: optim\.param_groups\.0\.bias\.amsgrad, .*"
        r"loaded by no rank: optim\.param_groups\.0\.amsgrad, ",
    ):
        smpckpt.Checkpointer(str(tmp_path)).resume("nested", got, go, options=smpckpt.ResumeOptions(strict=False))
    assert go.param_groups[0]["lr"] == 0.5 and torch.equal(got[0].weight, m[0].weight)
    saved, so = unused_branch_model()  # a parameter without state at the save: resumed so, strict or not
    unused_branch_step(saved, so, both=False)
    save_checkpoint(str(tmp_path / "u"), "a", model=saved, optimizer=so)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*skipped keys")
        got, go = unused_branch_model()
        resume_from_checkpoint(str(tmp_path / "u"), model=got, optimizer=go, strict=False)


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x


def test_user_content_weights_only_by_default(tmp_path: Any) -> None:
    m, _ = _model(0)
    with pytest.warns(UserWarning, match="allow_pickle=True"):
        save_checkpoint(str(tmp_path), "a", model=m, user_content={"obj": Custom(3)})
    with pytest.raises(
        UnsafeCheckpoint,
        match=r"^checkpoint 'a' \(.*a_partial\): its user_content holds objects weights-only loading rejects "
        r"\(its save warned\); nothing was loaded. Pass allow_pickle=True only if you trust this checkpoint$",
    ):
        resume_from_checkpoint(str(tmp_path), model=m)
    assert resume_from_checkpoint(str(tmp_path), model=m, allow_pickle=True)["obj"].x == 3


def test_user_content_only(tmp_path: Any) -> None:
    save_checkpoint(str(tmp_path), "a", user_content={"epoch": 2})
    assert resume_from_checkpoint(str(tmp_path)) == {"epoch": 2}
    # a model passed on resume for a checkpoint without model state: strict refusal
    with pytest.raises(
        LayoutMismatch,
        match=re.escape(
            "4 keys are not in the checkpoint: model.0.weight, model.0.bias, "
            "model.2.weight, model.2.bias (pass allow_partial_load=True"
        ),
    ):
        resume_from_checkpoint(str(tmp_path), model=_model(0)[0])


def test_layout_must_fit_the_world(tmp_path: Any) -> None:
    with pytest.raises(
        smpckpt.SpecError,
        match=re.escape(
            "the world (no process group) has 1 ranks but the layout "
            "ParallelLayout(tp=2, pp=1, dp=1, pp_layers=None) describes 2"
        ),
    ):
        save_checkpoint(str(tmp_path), "a", model=_model(0)[0], layout=smpckpt.ParallelLayout(tp=2))


def test_save_without_rng(tmp_path: Any) -> None:
    m, _ = _model(0)
    save_checkpoint(str(tmp_path), "a", model=m, save_rng=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume_from_checkpoint(str(tmp_path), model=m)
    assert last_resume_info().rng_restored == ()  # type: ignore[union-attr]


def test_saves_reuse_the_local_plan_and_follow_structure_changes(tmp_path: Any) -> None:
    """A Checkpointer keeps its save planner across saves (so do save_checkpoint's calls with one model:
    they share the Checkpointer kept on it): an unchanged structure is not planned again, a changed one
    (optimizer state appearing, a refused save in between) is, and every save is exact."""
    from smpckpt.api.calls import _KEPT

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)  # no step yet: no optimizer state
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o, user_content={"step": 0})
    kept = m.__dict__[_KEPT].checkpointer._planners._kept
    planner = kept["partial"]
    first = planner._cache.local
    assert first is not None and planner.entries == {}  # kept without the saved tensors
    with torch.no_grad():
        m[0].weight.add_(1.0)
    save_checkpoint(str(tmp_path), "b", model=m, optimizer=o, user_content={"step": 1})
    at_b = {k: v.clone() for k, v in m.state_dict().items()}
    assert kept["partial"] is planner
    assert planner._cache.local is not None and planner._cache.local.items is first.items  # not re-planned
    o.zero_grad()
    m(torch.randn(5, 4)).sum().backward()
    o.step()  # the optimizer's state appears: a new structure
    with pytest.raises(CheckpointExists):
        save_checkpoint(str(tmp_path), "b", model=m, optimizer=o, user_content={"step": 2})
    save_checkpoint(str(tmp_path), "c", model=m, optimizer=o, user_content={"step": 2})
    assert planner._cache.local is not None and planner._cache.local.items is not first.items
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    assert resume_from_checkpoint(str(tmp_path), tag="c", model=m2, optimizer=o2) == {"step": 2}
    assert _equal(m, m2)
    _assert_optim_equal(m, o, m2, o2)
    m3 = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    assert resume_from_checkpoint(str(tmp_path), tag="b", model=m3) == {"step": 1}
    got_b = m3.state_dict()
    assert all(torch.equal(got_b[k], v) for k, v in at_b.items())
    assert not torch.equal(got_b["0.weight"], m.state_dict()["0.weight"])  # "b" predates the step


class _Stage(nn.Module):
    """A pipeline stage's model: its own ``layers`` list (an activation among them holds no state)."""

    def __init__(self, kinds: str) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 2)
        self.layers = nn.ModuleList(nn.Linear(2, 2) if k == "L" else nn.ReLU() for k in kinds)


def test_a_partition_that_does_not_count_the_models_layers_is_refused_on_save_and_resume(tmp_path: Any) -> None:
    """``pp_layers=(3, 2)`` declared for stages of two layers each stored layers 0, 1, 3, 4 silently (rev58b
    F4): the checkpoint alone cannot tell a wrong partition from layers without state, so a later load under
    the right ``(2, 2)`` with ``strict=False`` gave stage 1 another layer. The model's ``layers`` list counts
    both: refused by name before anything is written or read; a state-less entry still counts."""
    wrong = smpckpt.ParallelLayout(pp=1, pp_layers=(3,))
    with pytest.raises(
        smpckpt.SpecError, match=r"stage 0 holds 3 layers by pp_layers=\(3,\) but the model's 'layers' holds 2"
    ):
        save_checkpoint(str(tmp_path), "a", model=_Stage("LL"), layout=wrong)
    assert not os.listdir(tmp_path)
    torch.manual_seed(0)
    saved = _Stage("LRL")  # three entries, one without state: the partition fits
    save_checkpoint(str(tmp_path), "a", model=saved, layout=wrong)
    with pytest.raises(smpckpt.SpecError, match=r"the model's 'layers' holds 4 \(layers.0 .. layers.3\)"):
        resume_from_checkpoint(str(tmp_path), model=_Stage("LRLL"), layout=wrong, strict=False)
    loaded = _Stage("LRL")
    resume_from_checkpoint(str(tmp_path), model=loaded, layout=wrong)
    assert _equal(saved, loaded)


def test_the_partition_check_counts_every_layers_list_that_the_rule_renumbers() -> None:
    """Past the first stage every ``layers`` list holding state must hold the stage's count (a head's own
    ``head.layers`` is shifted by the rule too: under another partition it would be read an entry off); at
    offset 0 nothing shifts, so one list holding the count is enough (a vision tower beside the text
    layers, rev59 F1); a list without state renames nothing (rev59 F2); wrapped lists and parameter lists
    count (rev59 F3); lists nested in a layer are the layer's own."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from smpckpt.model.layout import KeyMapper

    def check(model: nn.Module, stage: int, layers: tuple[int, ...] = (2, 2)) -> None:
        states = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names = [n for n, _ in model.named_modules(remove_duplicate=False)] + states
        KeyMapper(smpckpt.ParallelLayout(pp=len(layers), pp_layers=layers), stage).check_model_layers(names, states)

    def headed(head: int, kinds: str = "LL") -> nn.Module:
        model = _Stage(kinds)
        model.head = nn.Module()
        model.head.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(head))
        model.layers[0].inner = nn.Module()
        model.layers[0].inner.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
        return model

    with pytest.raises(
        smpckpt.SpecError, match=r"model's 'head.layers' holds 1 .* 2 `layers` lists: head.layers, layers"
    ):
        check(headed(1), 1)
    check(headed(2), 1)
    check(headed(1), 0)  # offset 0: nothing shifts; `layers` holds the count
    with pytest.raises(smpckpt.SpecError, match=r"stage 0 holds 3 layers"):
        check(headed(1), 0, (3, 1))  # neither list holds the count
    check(_Stage("LR"), 1)
    with pytest.raises(smpckpt.SpecError, match=r"model's 'layers' holds 3"):
        check(_Stage("LRL"), 1)
    pooled = _Stage("LL")
    pooled.pool = nn.Module()
    pooled.pool.layers = nn.ModuleList(nn.ReLU() for _ in range(3))
    check(pooled, 1)
    wrapped = _Stage("")
    wrapped.layers = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(smpckpt.SpecError, match=r"model's 'layers' holds 3"):
        check(wrapped, 1)
    gpt2 = nn.Module()
    gpt2.h = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(smpckpt.SpecError, match=r"no `layers` list holding state, so the rule renames no key"):
        check(gpt2, 1)
    check(gpt2, 1, (2, 0))  # a stage of no layers
    check(nn.Module(), 1)  # no state at all
    listed = _Stage("")
    listed.layers = nn.ParameterList(nn.Parameter(torch.zeros(2)) for _ in range(3))
    with pytest.raises(smpckpt.SpecError, match=r"model's 'layers' holds 3"):
        check(listed, 1)


@pytest.mark.parametrize("how", ["sync", "async", "torch_save", "full"])
def test_a_user_content_of_mibs_round_trips_bit_exactly(tmp_path: Any, how: str) -> None:
    """A few MiB of user_content (EMA weights, loader buffers) is written from the buffer ``torch.save``
    filled and resumed from the stored bytes, not copies (fix68b): bit-exact through a sync, an async and a
    ``torch_save`` save and a full export, whose ``user_content.pt`` stock ``torch.load`` reads; a change
    the caller makes once the save returned is not in it."""
    g = torch.Generator().manual_seed(5)
    uc = {"ema": torch.randn(1 << 20, generator=g), "buf": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)}
    want = {k: v.clone() for k, v in uc.items()}
    m, o = _model(0)
    kw: dict[str, Any] = {
        "async": {"options": smpckpt.SaveOptions(async_save=True)},
        "torch_save": {"options": smpckpt.SaveOptions(format="torch_save")},
        "full": {"partial": False},
    }.get(how, {})
    fut = save_checkpoint(str(tmp_path), "t", model=m, optimizer=o, user_content=uc, **kw)
    uc["ema"].add_(1.0)  # after the save returned: not in the checkpoint
    if fut is not None:
        fut.result()
    m2, o2 = _model(1)
    got = resume_from_checkpoint(str(tmp_path), "t", model=m2, optimizer=o2, partial=how != "full")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), how
    assert _equal(m, m2)
    if how == "full":
        stock = torch.load(tmp_path / "t" / "user_content.pt", weights_only=True)
        assert all(torch.equal(stock[k], want[k]) for k in want)


def test_a_resumed_user_content_of_kibs_gives_its_read_buffer_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev69b: an object record over 4 KiB was handed on as a view of the read buffer it landed in, and the
    buffer was never given back to the pool (a resume keeps its user_content's view: the whole request, at
    least the pool's 1 MiB, pinned for a few KiB). Now a record of less than half its buffer is copied out:
    every buffer the resume took goes back to the pool, and the user_content is bit-exact."""
    from smpckpt.storage.read._fetch import BufferPool

    uc = {"ema": torch.arange(5000, dtype=torch.float32), "step": 7}  # a record of about 20 KiB
    m, o = _model(0)
    save_checkpoint(str(tmp_path), "t", model=m, optimizer=o, user_content=uc)
    out: dict[int, int] = {}  # id of each buffer taken -> times taken minus times given back
    alive: list[bytearray] = []
    take, give_back = BufferPool.take, BufferPool.give_back

    def counted_take(pool: BufferPool, n: int) -> bytearray:
        buf = take(pool, n)
        out[id(buf)] = out.get(id(buf), 0) + 1
        alive.append(buf)  # no id reused by a later buffer
        return buf

    def counted_give_back(pool: BufferPool, data: memoryview) -> None:
        out[id(data.obj)] = out.get(id(data.obj), 0) - 1
        give_back(pool, data)

    monkeypatch.setattr(BufferPool, "take", counted_take)
    monkeypatch.setattr(BufferPool, "give_back", counted_give_back)
    m2, o2 = _model(1)
    got = resume_from_checkpoint(str(tmp_path), "t", model=m2, optimizer=o2)
    assert out and all(n == 0 for n in out.values()), f"{sum(out.values())} read buffer(s) not given back"
    assert set(got) == {"ema", "step"} and torch.equal(got["ema"], uc["ema"]) and got["step"] == 7
    assert _equal(m, m2)
