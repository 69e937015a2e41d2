"""Data-loss and escape paths of the smp-style API (issue 8): globbing deletes, restarts after each
crash point of commit -> newest -> retention, stale debris, hostile siblings, clear errors."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import time
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import (
    AsyncOptions,
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    FastTier,
    LayoutMismatch,
    ResumeOptions,
    Retention,
    SpecError,
    UnsafeCheckpoint,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
)
from smpckpt.catalog.root import scan_root, write_newest
from smpckpt.errors import LOADED_IN_PLACE
from smpckpt.storage import FsspecStorageWriter, checkpoint_state, open_fs, read_manifest
from smpckpt.storage.format.manifest import MANIFEST_NAME
from smpckpt.tools.cli import main


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(5, 4)).sum().backward()
    o.step()
    return m, o


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and sa
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _tags(root: str, options: dict[str, Any] | None = None) -> dict[str, str]:
    return {r.tag: r.state for r in scan_root(root, storage_options=options)}


# -- 1. glob characters never reach a delete ---------------------------------------------------------
@pytest.mark.parametrize("where", ["memory", "s3"])
def test_retention_and_prune_in_globby_roots_touch_only_their_own_root(where: str, request: Any) -> None:
    if where == "s3":
        base, options = request.getfixturevalue("s3_root")
    else:
        base, options = f"memory://globroots{time.monotonic_ns()}", None
    m, _ = _model(0)
    # sibling roots whose names a glob would match: "p*" and "p[12]" match "p1" and "p2"
    for root in (f"{base}/p1", f"{base}/p2"):
        for i in range(2):
            save_checkpoint(root, f"s{i}", model=m, storage_options=options)
    for i in range(3):
        save_checkpoint(f"{base}/p[12]", f"s{i}", model=m, num_kept_partial_checkpoints=1, storage_options=options)
    save_checkpoint(f"{base}/p*", "s0", model=m, storage_options=options)
    rc, out, _ = _run_cli(
        "prune", f"{base}/p*", "--keep", "1", *(["--storage-options", json.dumps(options)] if options else [])
    )
    assert rc == 0 and "nothing to remove" in out
    for root in (f"{base}/p1", f"{base}/p2"):
        assert _tags(root, options) == {"s0": "committed", "s1": "committed"}
        m2, _ = _model(5)
        resume_from_checkpoint(root, model=m2, storage_options=options)
        _assert_same_params(m, m2)
    assert _tags(f"{base}/p[12]", options) == {"s2": "committed"}
    assert _tags(f"{base}/p*", options) == {"s0": "committed"}


# -- 5. a restart after each crash point of commit -> newest -> retention ------------------------------
def _steps(root: str, upto: int, **kw: Any) -> nn.Module:
    m = None
    for step in range(upto + 1):
        m, o = _model(step)
        save_checkpoint(root, f"step{step}", model=m, optimizer=o, user_content={"step": step}, **kw)
    assert m is not None
    return m


def test_restart_after_crash_between_commit_and_newest_resumes_the_later_tag_and_saves_on(tmp_path: Any) -> None:
    root = str(tmp_path)
    last = _steps(root, 2)
    write_newest(*open_fs(root), "step1")  # the state a kill right after step2's commit leaves
    m, o = _model(9)
    with pytest.warns(UserWarning, match="'step2' was numbered after it"):
        uc = resume_from_checkpoint(root, model=m, optimizer=o)
    assert uc == {"step": 2}
    _assert_same_params(last, m)
    info = last_resume_info()
    assert info is not None and info.tag == "step2" and info.fell_back
    # the job goes on from step 3 without manual help
    save_checkpoint(root, "step3", model=m, optimizer=o, user_content={"step": 3})
    assert (tmp_path / "newest").read_text().strip() == "step3"


class _KilledBeforeCommit(FsspecStorageWriter):
    def _write_manifest(self, data: bytes) -> None:
        raise RuntimeError("killed before the commit")

    def discard_failed_save(self) -> list[str]:
        return []  # a killed process cleans nothing up


class _DiskFullAtCommit(FsspecStorageWriter):
    """Every data file is durable; the metadata copy hits a full disk (a failure, not a kill)."""

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), gen_name)


def test_a_failed_save_removes_its_files_so_the_retry_leaves_none_beside_its_own(
    tmp_path: Any, monkeypatch: Any
) -> None:
    import smpckpt.api._save as api

    root = str(tmp_path)
    _steps(root, 1)
    m, o = _model(2)
    with monkeypatch.context() as patch:
        patch.setattr(api, "FsspecStorageWriter", _DiskFullAtCommit)
        for tag in ("step1", "step2"):  # over a committed tag (overwrite) and a new one
            with pytest.raises(CheckpointError, match=os.strerror(errno.ENOSPC)):
                save_checkpoint(root, tag, model=m, optimizer=o, user_content={"step": 2}, overwrite=True)
    # the committed step1 is untouched, and step2's folder is gone with its files
    assert _tags(root) == {"step0": "committed", "step1": "committed"}
    assert not os.path.exists(os.path.join(root, "step2_partial"))
    m1, o1 = _model(9)
    assert resume_from_checkpoint(root, model=m1, optimizer=o1) == {"step": 1}
    # the retries commit, and each folder holds only its own generation
    for tag in ("step1", "step2"):
        save_checkpoint(root, tag, model=m, optimizer=o, user_content={"step": 2}, overwrite=True)
        manifest = read_manifest(os.path.join(root, f"{tag}_partial"))
        expected = {f.name for f in manifest.files} | {manifest.metadata.name, ".metadata", "smpckpt.manifest.json"}
        assert set(os.listdir(os.path.join(root, f"{tag}_partial"))) == expected
    m3, o3 = _model(9)
    assert resume_from_checkpoint(root, model=m3, optimizer=o3) == {"step": 2}
    _assert_same_params(m, m3)


def _make_uncommitted(root: str, tag: str, monkeypatch: Any, seed: int = 0) -> None:
    import smpckpt.api._save as api

    m, o = _model(seed)
    with monkeypatch.context() as patch:
        patch.setattr(api, "FsspecStorageWriter", _KilledBeforeCommit)
        with pytest.raises(CheckpointError, match="killed before the commit"):
            save_checkpoint(root, tag, model=m, optimizer=o, user_content={"step": seed})


def test_restart_after_crash_before_commit_resumes_previous_and_resaves_the_tag(
    tmp_path: Any, monkeypatch: Any
) -> None:
    root = str(tmp_path)
    _steps(root, 1)
    _make_uncommitted(root, "step2", monkeypatch, seed=2)
    assert _tags(root) == {"step0": "committed", "step1": "committed", "step2": "uncommitted"}
    m, o = _model(9)
    assert resume_from_checkpoint(root, model=m, optimizer=o) == {"step": 1}
    # replaying step 2 re-saves the same tag over the debris of the killed save
    m2, o2 = _model(2)
    save_checkpoint(root, "step2", model=m2, optimizer=o2, user_content={"step": 2})
    m3, o3 = _model(9)
    assert resume_from_checkpoint(root, model=m3, optimizer=o3) == {"step": 2}
    _assert_same_params(m2, m3)


def test_restart_after_crash_before_retention_trims_on_the_next_save(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 3)  # no retention ran: the state a kill right after `newest` moved leaves
    m, o = _model(9)
    assert resume_from_checkpoint(root, model=m, optimizer=o) == {"step": 3}
    save_checkpoint(root, "step4", model=m, optimizer=o, user_content={"step": 4}, num_kept_partial_checkpoints=2)
    assert _tags(root) == {"step3": "committed", "step4": "committed"}


def test_restart_after_crash_mid_retention_finishes_the_removal(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 2)
    # a removal killed after its marker and the manifest's delete (remove_checkpoint's first steps)
    (tmp_path / "step0_partial" / "smpckpt.removing").write_text("removing\n")
    os.remove(tmp_path / "step0_partial" / "smpckpt.manifest.json")
    # a folder that merely lost its manifest (no marker) is not ours to judge: it stays
    os.remove(tmp_path / "step1_partial" / "smpckpt.manifest.json")
    assert _tags(root) == {"step0": "removing", "step1": "uncommitted", "step2": "committed"}
    m, o = _model(9)
    assert resume_from_checkpoint(root, model=m, optimizer=o) == {"step": 2}
    save_checkpoint(root, "step3", model=m, optimizer=o, user_content={"step": 3}, num_kept_partial_checkpoints=2)
    assert _tags(root) == {"step1": "uncommitted", "step2": "committed", "step3": "committed"}


def test_a_clean_up_that_fails_does_not_hide_the_saves_own_error(tmp_path: Any, monkeypatch: Any) -> None:
    import smpckpt.api._save as api

    def broken(self: Any, error: Any = None) -> list[str]:
        raise RuntimeError("clean-up broke")

    m, o = _model(2)
    with monkeypatch.context() as patch:
        patch.setattr(api, "FsspecStorageWriter", _DiskFullAtCommit)
        patch.setattr(_DiskFullAtCommit, "discard_failed_save", broken)
        with pytest.raises(CheckpointError, match=os.strerror(errno.ENOSPC)) as info:
            save_checkpoint(str(tmp_path), "step0", model=m, optimizer=o)
    assert "clean-up broke" not in str(info.value)


# -- 6. stale debris of killed saves ------------------------------------------------------------------
def test_stale_uncommitted_folders_are_removed_by_age_only(tmp_path: Any, monkeypatch: Any) -> None:
    root = str(tmp_path)
    _make_uncommitted(root, "old", monkeypatch)
    _make_uncommitted(root, "fresh", monkeypatch)
    hours_ago = time.time() - 7200
    for dirpath, _, files in os.walk(tmp_path / "old_partial"):
        for f in [*files, ""]:  # "": the folder itself (a folder's time counts too, on local disk)
            os.utime(os.path.join(dirpath, f), (hours_ago, hours_ago))
    m, _ = _model(0)
    save_checkpoint(root, "good", model=m)  # no stale cleanup unless asked
    assert _tags(root) == {"fresh": "uncommitted", "good": "committed", "old": "uncommitted"}
    rc, out, _ = _run_cli("prune", root, "--uncommitted-older-than", "1h", "--dry-run")
    assert rc == 0 and "would remove old (uncommitted, stale)" in out
    assert "old" in _tags(root)
    save_checkpoint(root, "good2", model=m, remove_uncommitted_older_than=3600)
    assert _tags(root) == {"fresh": "uncommitted", "good": "committed", "good2": "committed"}
    assert not (tmp_path / "old_partial").exists()
    rc, out, _ = _run_cli("prune", root, "--uncommitted-older-than", "0s")
    assert rc == 0 and out.strip() == "removed fresh (uncommitted, stale)"
    assert _tags(root) == {"good": "committed", "good2": "committed"}


def test_prune_needs_something_to_do(tmp_path: Any) -> None:
    rc, _, err = _run_cli("prune", str(tmp_path))
    assert rc == 2 and "--keep N, --uncommitted-older-than AGE" in err


# -- 7. one hostile sibling folder does not break the root ---------------------------------------------
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_hostile_sibling_is_listed_as_unsafe_and_the_root_keeps_working(tmp_path: Any) -> None:
    root = str(tmp_path)
    marker = tmp_path / "pwned"
    last = _steps(root, 2)
    (tmp_path / "zzz_partial").mkdir()
    (tmp_path / "zzz_partial" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    os.remove(tmp_path / "newest")
    rc, out, _ = _run_cli("ls", root)
    assert rc == 0 and "zzz" in out and "unsafe" in out
    assert _tags(root)["zzz"] == "unsafe"
    m, o = _model(9)
    with pytest.warns(UserWarning, match="resuming from the newest committed checkpoint 'step2'") as warned:
        assert resume_from_checkpoint(root, model=m, optimizer=o) == {"step": 2}
    assert [w.filename for w in warned if "newest committed" in str(w.message)] == [__file__]  # the caller's line
    _assert_same_params(last, m)
    m, o = _model(9)  # through a fast tier holding nothing (rev62d F2: the warning named the package's line)
    with pytest.warns(UserWarning, match="resuming from the newest committed checkpoint 'step2'") as warned:
        resume_from_checkpoint(root, model=m, optimizer=o, options=FastTier(local_path=str(tmp_path) + "_fast"))
    assert [w.filename for w in warned if "newest committed" in str(w.message)] == [__file__]
    _assert_same_params(last, m)
    m3, o3 = _model(3)
    save_checkpoint(root, "step3", model=m3, optimizer=o3, num_kept_partial_checkpoints=2)
    assert _tags(root) == {"step2": "committed", "step3": "committed", "zzz": "unsafe"}
    rc, out, _ = _run_cli("prune", root, "--keep", "1")
    assert rc == 0 and out.strip() == "removed step2"
    assert _tags(root) == {"step3": "committed", "zzz": "unsafe"}
    assert not marker.exists()


# -- 8. clear errors -------------------------------------------------------------------------------------
def test_optimizer_over_another_model_is_named(tmp_path: Any) -> None:
    m, _ = _model(0)
    _, other_opt = _model(1)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \[3, 4\].*not a parameter of the model"
    ):
        save_checkpoint(str(tmp_path), "a", model=m, optimizer=other_opt)
    assert not os.listdir(tmp_path)

    class Fragile(nn.Sequential):  # rev63f F1b: the FSDP2 retry called state_dict, which may raise (or gather)
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("state_dict exploded")

    fragile = Fragile(*m)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        save_checkpoint(str(tmp_path), "a", model=fragile, optimizer=other_opt)


def test_spec_rule_of_the_wrong_type_is_named(tmp_path: Any) -> None:
    m, _ = _model(0)
    with pytest.raises(SpecError, match=r"spec rule 'model\.\*': needs a ShardSpec.*got int 3"):
        save_checkpoint(str(tmp_path), "a", model=m, specs={"model.*": 3})


def test_unknown_storage_options_on_a_local_path_are_refused(tmp_path: Any) -> None:
    m, _ = _model(0)
    with pytest.raises(ValueError, match=r"storage_options \['key'\] do not apply to a local path"):
        save_checkpoint(str(tmp_path), "a", model=m, storage_options={"key": "AKIA..."})
    assert not os.listdir(tmp_path)


def test_refused_metadata_surfaces_as_unsafe_checkpoint(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 0)
    folder = tmp_path / "step0_partial"
    manifest = json.loads((folder / "smpckpt.manifest.json").read_text())
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(str(marker)))
    (folder / manifest["metadata"]["name"]).write_bytes(payload)
    # a consistent (crafted) manifest: digests match the payload
    from smpckpt.storage import Manifest
    from smpckpt.storage.format._checksum import hash_bytes

    parsed = Manifest.from_bytes((folder / "smpckpt.manifest.json").read_bytes())
    import dataclasses

    crafted = dataclasses.replace(
        parsed, metadata=dataclasses.replace(parsed.metadata, size=len(payload), digest=hash_bytes(payload))
    )
    (folder / "smpckpt.manifest.json").write_bytes(crafted.to_bytes())
    m, o = _model(9)
    with pytest.raises(UnsafeCheckpoint, match="metadata"):
        resume_from_checkpoint(root, tag="step0", model=m, optimizer=o)
    assert not marker.exists()


def test_flipped_digest_in_the_manifest_blames_the_manifest(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 0)
    path = tmp_path / "step0_partial" / "smpckpt.manifest.json"
    obj = json.loads(path.read_text())
    digest = obj["metadata"]["xxh3_64"]
    obj["metadata"]["xxh3_64"] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    path.write_text(json.dumps(obj, indent=1))
    m, o = _model(9)
    with pytest.raises(CheckpointCorrupt, match="manifest.*own checksum"):
        resume_from_checkpoint(root, tag="step0", model=m, optimizer=o)
    rc, out, _ = _run_cli("verify", f"{root}/step0")
    assert rc == 1 and "own checksum" in out + _


def test_a_resume_failing_in_its_read_says_the_model_holds_some_of_the_checkpoint(tmp_path: Any) -> None:
    """A resume loads in place: one failing mid-read (a damaged file) left the tensors read before it with the
    checkpoint's values, and its error did not say so; a job that starts afresh after it trained a model half
    loaded, half initialised. The error says it now, and so does a refusal after the read (param groups that
    differ); a resume refused before its read (a shape that does not match) leaves the model as it was and does
    not say it."""
    root = str(tmp_path)
    m, o = _model(0)
    save_checkpoint(root, "a", model=m, optimizer=o)
    torch.manual_seed(1)
    two = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    groups = torch.optim.AdamW(
        [{"params": two[0].parameters(), "lr": 1e-2}, {"params": two[2].parameters(), "lr": 1e-3}]
    )
    save_checkpoint(root, "b", model=two, optimizer=groups)
    data = max((p for p in (tmp_path / "a_partial").iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    fresh, fresh_opt = _model(9)
    with pytest.raises(CheckpointCorrupt) as failed:
        resume_from_checkpoint(root, tag="a", model=fresh, optimizer=fresh_opt)
    assert str(failed.value).endswith(LOADED_IN_PLACE), failed.value
    # refused after its read (rev66a F1): two param groups saved, one live
    one, one_opt = _model(9)
    with pytest.raises(LayoutMismatch) as after:
        resume_from_checkpoint(root, tag="b", model=one, optimizer=one_opt)
    assert str(after.value).endswith(LOADED_IN_PLACE), after.value
    assert torch.equal(one[0].weight, two[0].weight)  # what the note says: loaded in place
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        resume_from_checkpoint(root, tag="a", model=other)
    assert "holds global shape" in str(refused.value) and "loads in place" not in str(refused.value), refused.value
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_a_ctrl_c_part_way_through_a_resumes_read_says_the_model_holds_some_of_the_checkpoint(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hunt69b F4: a KeyboardInterrupt part-way through a resume's read (a notebook's interrupted cell) left some
    parameters with the checkpoint's values and the others live, and said nothing (an Exception there says so):
    the next save committed the mix. It keeps its type and now carries the same note."""
    from smpckpt.planners import ParallelLoadPlanner

    root = str(tmp_path)
    m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0)
    save_checkpoint(root, "a", model=m)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(2.0)
    real, read = ParallelLoadPlanner.commit_tensor, [0]

    def interrupted(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        real(self, read_item, tensor)
        read[0] += 1
        if read[0] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(ParallelLoadPlanner, "commit_tensor", interrupted)
    with Checkpointer(root) as ckpt, pytest.raises(KeyboardInterrupt) as stopped:
        ckpt.resume("a", model=m)
    assert type(stopped.value) is KeyboardInterrupt and LOADED_IN_PLACE[2:] in stopped.value.__notes__, stopped.value
    assert {float(p.flatten()[0]) for p in m.parameters()} == {1.0, 2.0}  # what the note says: half loaded


def test_a_translated_resume_without_optimizer_failing_in_its_read_leaves_the_model_and_says_nothing_was_loaded(
    tmp_path: Any,
) -> None:
    """rev66e F5: with a translate_function and no optimizer the read lands in an aside copy; one failing
    mid-read still ended with the "loaded in place" note, though the model was untouched."""
    root = str(tmp_path)
    m, _ = _model(0)
    save_checkpoint(root, "a", model=m)
    for data in (p for p in (tmp_path / "a_partial").iterdir() if p.suffix == ".distcp"):
        damaged = bytearray(data.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        data.write_bytes(bytes(damaged))
    fresh, _ = _model(9)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    options = ResumeOptions(translate_function=lambda sd: sd)
    with pytest.raises(CheckpointCorrupt, match="a_partial") as failed:
        resume_from_checkpoint(root, tag="a", model=fresh, options=options)
    assert LOADED_IN_PLACE not in str(failed.value), failed.value
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(CheckpointCorrupt) as plain:  # without the function the read is in place: it says so
        resume_from_checkpoint(root, tag="a", model=fresh)
    assert str(plain.value).endswith(LOADED_IN_PLACE), plain.value


def test_a_translated_resume_without_optimizer_says_loaded_exactly_when_its_apply_wrote_the_model(
    tmp_path: Any,
) -> None:
    """rev67a F1/F6: with a translate_function and no optimizer the read lands aside, but the apply writes the
    model: one failing part-way (a size mismatch after the first layer) left no note; one whose
    load_state_dict override refuses torch's keywords wrote nothing, yet claimed the model held the values."""
    root = str(tmp_path)
    m, _ = _model(0)
    save_checkpoint(root, "a", model=m)
    fresh, _ = _model(9)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}

    def transposed(sd: dict[str, Any]) -> dict[str, Any]:  # a translate bug: the last weight transposed
        return {**sd, "2.weight": sd["2.weight"].t()}

    with pytest.raises(RuntimeError, match="2.weight") as failed:
        resume_from_checkpoint(root, tag="a", model=fresh, options=ResumeOptions(translate_function=transposed))
    assert str(failed.value).endswith(LOADED_IN_PLACE), failed.value
    assert torch.equal(fresh[0].weight, m[0].weight) and not torch.equal(fresh[0].weight, before["0.weight"])

    class OldStyle(nn.Linear):
        def load_state_dict(self, state_dict: Any) -> Any:  # type: ignore[override]  # an old-style override
            return super().load_state_dict(state_dict)

    torch.manual_seed(0)
    save_checkpoint(root, "b", model=OldStyle(3, 3))
    old = OldStyle(3, 3)
    kept = old.weight.clone()
    with pytest.raises(TypeError, match="OldStyle.load_state_dict") as refused:
        resume_from_checkpoint(root, tag="b", model=old, options=ResumeOptions(translate_function=lambda sd: sd))
    assert LOADED_IN_PLACE not in str(refused.value) and torch.equal(old.weight, kept), refused.value


def test_verify_addresses_the_folder_of_a_tag(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 0)
    assert _run_cli("verify", f"{root}/step0")[0] == 0
    assert _run_cli("verify", f"{root}/step0_partial")[0] == 0


def test_save_over_a_committed_tag_still_refused(tmp_path: Any) -> None:
    root = str(tmp_path)
    _steps(root, 0)
    before = read_manifest(f"{root}/step0_partial").save_id
    m, o = _model(3)
    with pytest.raises(CheckpointExists, match="overwrite=True"):
        save_checkpoint(root, "step0", model=m, optimizer=o)
    assert read_manifest(f"{root}/step0_partial").save_id == before
    assert checkpoint_state(f"{root}/step0_partial") == "committed"


def _clock_behind(monkeypatch: pytest.MonkeyPatch, seconds: int) -> None:
    """A new job on a node whose clock is ``seconds`` behind the previous job's: every save stamped in the
    past (the caller's new model gets a new Checkpointer: no root known yet)."""
    import contextlib
    import importlib

    behind = time.time_ns() - seconds * 10**9
    monkeypatch.setattr(time, "time_ns", lambda: behind)
    with contextlib.suppress(ImportError):  # before issue 42 the save clock kept its own reference
        clock = importlib.import_module("smpckpt.catalog._save_clock")
        monkeypatch.setattr(clock, "_latest", {})
        monkeypatch.setattr(clock, "_now", lambda: behind)


@pytest.mark.parametrize("newest", ["deleted", "stale"])
def test_a_later_job_is_ordered_after_the_earlier_one_whatever_the_clocks_say(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, newest: str
) -> None:
    """Issue 42, row 7: ``newest`` deleted or stale, the second job's clock an hour behind, no resume.
    Its saves s5-s7 must come after the old run's s1-s4: a tag-less resume takes s7 (not s4), and
    ``prune --keep 3`` keeps s5-s7 (before: it deleted them and kept the old run's)."""
    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("s1", "s2", "s3", "s4"):
        save_checkpoint(root, tag, model=m, optimizer=o)

    def spoil_newest() -> None:
        if newest == "deleted":
            os.remove(os.path.join(root, "newest"))
        else:  # updates of newest lost: it names an older checkpoint of the old run
            write_newest(open_fs(root)[0], root, "s2")

    spoil_newest()
    _clock_behind(monkeypatch, 3600)
    for i, tag in enumerate(("s5", "s6", "s7")):
        m, o = _model(10 + i)
        save_checkpoint(root, tag, model=m, optimizer=o)
    records = [r for r in scan_root(root) if r.committed]
    assert [r.tag for r in records] == ["s1", "s2", "s3", "s4", "s5", "s6", "s7"]
    assert [r.order[0] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    stamps = [r.manifest.extra["saved_at_ns"] for r in records if r.manifest is not None]
    assert stamps[-1] < stamps[0]  # the clocks did disagree
    spoil_newest()
    back, bo = _model(99)
    with pytest.warns(UserWarning, match="newest"):
        resume_from_checkpoint(root, model=back, optimizer=bo)
    assert last_resume_info().tag == "s7" and last_resume_info().fell_back
    _assert_same_params(back, m)
    rc, _, err = _run_cli("prune", root, "--keep", "3")
    assert rc == 0, err
    kept = ["s5", "s6", "s7"] if newest == "deleted" else ["s2", "s5", "s6", "s7"]  # (never what newest names)
    assert [r.tag for r in scan_root(root) if r.committed] == kept


def test_a_rollback_numbers_past_the_abandoned_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job rolls back to an explicit older tag on a node whose clock is a day behind: its new checkpoints
    outrank the abandoned run's later ones, which retention neither counts nor removes (one listing of the
    root at the first save: an explicit-tag resume lists nothing)."""
    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("a", "b", "c"):
        save_checkpoint(root, tag, model=m, optimizer=o)
    _clock_behind(monkeypatch, 86_400)
    m, o = _model(0)  # the new job's model, and so its own Checkpointer
    resume_from_checkpoint(root, tag="a", model=m, optimizer=o)
    for tag in ("d", "e"):
        save_checkpoint(root, tag, model=m, optimizer=o, num_kept_partial_checkpoints=2)
    assert [(r.tag, r.order[0]) for r in scan_root(root) if r.committed] == [("b", 2), ("c", 3), ("d", 4), ("e", 5)]


def test_a_tagless_resume_seeds_the_numbers_without_another_listing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a tag-less resume (which listed the root) the next saves count on without listing it again;
    a damaged number (beyond any plausible count) in a manifest is not followed."""
    import smpckpt.catalog.root as listing
    from smpckpt.catalog.root import SequenceCounter

    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("a", "b"):
        save_checkpoint(root, tag, model=m, optimizer=o)
    _clock_behind(monkeypatch, 600)
    m, o = _model(0)  # a new job
    resume_from_checkpoint(f"file://{root}", model=m, optimizer=o)  # the root spelled another way
    assert last_resume_info().tag == "b"
    monkeypatch.setattr(listing, "scan_root", lambda *a, **k: pytest.fail("listed the root again"))
    save_checkpoint(f"{root}/", "c", model=m, optimizer=o)
    assert read_manifest(os.path.join(root, "c_partial")).extra["sequence"] == 3
    counter = SequenceCounter(root)
    counter.saw(3, listed=True)
    counter.saw(2**80)  # a damaged manifest's number: ignored
    assert counter.next() == 4


def test_retention_removes_nothing_when_a_checkpoint_is_numbered_after_the_one_just_saved(tmp_path: Any) -> None:
    """Another job saving into this root at the same time drew a higher number than the checkpoint just
    saved: retention refuses to guess which are the oldest, and says so."""
    from smpckpt import Checkpointer, Retention

    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("a", "b", "c"):
        save_checkpoint(root, tag, model=m, optimizer=o)
    ckpt = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=2))
    ckpt._counter.saw(0, listed=True)  # this job believes the root empty: another job wrote a, b, c
    # ... while this save drew its number: that job's ``newest`` (read by a save to number itself after
    # another writer's commit) was not there yet
    os.remove(os.path.join(root, "newest"))
    ckpt.save("d", model=m, optimizer=o)
    assert read_manifest(os.path.join(root, "d_partial")).extra["sequence"] == 1
    assert {r.tag for r in scan_root(root) if r.committed} == {"a", "b", "c", "d"}  # nothing removed


def test_retention_never_removes_the_tag_newest_names_when_another_job_published_it_late(tmp_path: Any) -> None:
    """Two jobs in one root: job B commits c (numbered 3) and points ``newest`` at it; job A's b (numbered 2)
    committed before, but A's ``newest`` lands after B's; then B's retention (keep 1) runs. It removed b, so
    ``newest`` named a removed folder until the next save (seen with two 2-rank jobs racing,
    /work/hunt63/hunt63b/twojobs.py). README: retention never removes the tag ``newest`` names."""
    from smpckpt.catalog.root import apply_retention

    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("a", "b", "c"):
        save_checkpoint(root, tag, model=m, optimizer=o)
    fs, root_path = open_fs(root)
    write_newest(fs, root_path, "b")  # A's late publish, after B's commit of c
    result = apply_retention(root, 1, protected={"c"}, just_saved="c")  # what B's save runs (api._save.retain)
    assert result.removed == ("a",)
    assert [r.tag for r in scan_root(root) if r.committed] == ["b", "c"]


def test_retention_reads_newest_again_before_each_removal(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """rev63d R3: ``newest`` was read for every doomed tag before the first removal, so another job's publish
    of d landing during the removal of a (seconds on S3) left d unprotected: removed, ``newest`` dangling."""
    import smpckpt.catalog.root as catalog_root

    root = str(tmp_path)
    m, o = _model(0)
    for tag in ("a", "b", "c", "d", "e"):
        save_checkpoint(root, tag, model=m, optimizer=o)
    fs, root_path = open_fs(root)
    real = catalog_root.remove_checkpoint

    def publishing_meanwhile(url: str, *args: Any, **kwargs: Any) -> Any:
        write_newest(fs, root_path, "d")  # the other job's late publish, during this removal
        return real(url, *args, **kwargs)

    monkeypatch.setattr(catalog_root, "remove_checkpoint", publishing_meanwhile)
    result = catalog_root.apply_retention(root, 1, protected={"e"}, just_saved="e")
    assert result.removed == ("a", "b", "c")
    assert [r.tag for r in scan_root(root) if r.committed] == ["d", "e"]


def test_old_checkpoints_without_numbers_come_first_in_time_order(tmp_path: Any) -> None:
    """Manifests written before sequence numbers (no ``extra["sequence"]``; stock DCP folders are not
    committed checkpoints) are ordered among themselves by save time, all before any numbered one; a
    root holding them numbers its first new save 1."""
    from smpckpt.catalog.root import record_order

    old = {"extra": {"saved_at_ns": 5}, "save_id": "x"}
    assert record_order(old) == (0, 5, "x")
    assert record_order({"created": "1970-01-01T00:00:01+00:00", "save_id": "y"}) == (0, 10**9, "y")
    assert record_order({"extra": {"sequence": 1, "saved_at_ns": 1}, "save_id": "z"}) > record_order(old)
    assert record_order({"extra": {"sequence": True}, "save_id": "w"})[0] == 0


def test_a_tiered_save_is_numbered_after_the_fast_tiers_copies(tmp_path: Any) -> None:
    """Saves kept only in the fast tier (not drained) are numbered too: a new process saving without a
    resume numbers its checkpoint after them, not after the durable root's highest alone."""
    from smpckpt.api._tiers import durable_key, job_folder

    root, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
    m, o = _model(0)
    tier = {"local_path": fast, "replicas": 1, "durable_every": 2, "num_kept_local": None}
    for tag in ("s1", "s2", "s3"):  # only s2 is drained to the root; s3 is in the fast tier alone
        save_checkpoint(root, tag, model=m, optimizer=o, **tier)
    smpckpt_wait()
    assert [r.tag for r in scan_root(root) if r.committed] == ["s2"]
    m, o = _model(1)  # a new job (its own Checkpointer), no resume
    save_checkpoint(root, "s4", model=m, optimizer=o, **tier)
    job = job_folder(fast, durable_key(root, None))  # the fast tier's folder of this job (issue 46)
    assert read_manifest(os.path.join(job, "s4_partial")).extra["sequence"] == 4
    assert [r.order[0] for r in scan_root(job) if r.committed] == [1, 2, 3, 4]
    smpckpt_wait()  # s4's drain: left running, it failed once tmp_path went and the exit hook exited 1 (hunt65a)


def smpckpt_wait() -> None:
    from smpckpt import wait_for_saves

    wait_for_saves()


# -- 10. a roll-back by tag: retention and the tag-less fallback follow the job's history --------------
def _rolled_back(root: str, keep: int | None, later: int = 1) -> dict[int, nn.Module]:
    """s1..s5 saved; a restarted job resumes s3 by tag (s4, s5 diverged) and saves ``later`` more, from s6."""
    ck, models = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=keep)), {}
    for step in range(1, 6):
        models[step], o = _model(step)
        ck.save(f"s{step}", models[step], o, user_content={"step": step})
    restarted = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=keep))
    m, o = _model(0)
    assert restarted.resume("s3", m, o) == {"step": 3}
    for step in range(6, 6 + later):
        models[step], o = _model(step)
        restarted.save(f"s{step}", models[step], o, user_content={"step": step})
    return models


def _damage(root: str, tag: str) -> None:
    with open(os.path.join(root, f"{tag}_partial", MANIFEST_NAME), "w") as f:
        f.write("{not json")


def test_retention_after_a_rollback_keeps_the_history_and_the_abandoned_saves(tmp_path: Any) -> None:
    root = str(tmp_path)
    _rolled_back(root, keep=3)
    # the history is s6 <- s3 (s1, s2 went with the earlier saves); s4, s5 (abandoned) stay, uncounted
    assert _tags(root) == {t: "committed" for t in ("s3", "s4", "s5", "s6")}
    assert read_manifest(os.path.join(root, "s6_partial")).extra["abandoned"] == [[4, 5]]


def test_fallback_after_a_rollback_never_resumes_an_abandoned_save(tmp_path: Any) -> None:
    root = str(tmp_path)
    models = _rolled_back(root, keep=None)
    _damage(root, "s6")  # the only save of the history after the roll-back: its own record is lost with it
    m, o = _model(9)
    with pytest.warns(UserWarning, match=r"checkpoint 's3' of the job's history \(not \['s5', 's4'\]"):
        assert Checkpointer(root).resume(None, m, o) == {"step": 3}
    _assert_same_params(models[3], m)
    rc, out, _ = _run_cli("ls", root)
    note = f"note: {root}/smpckpt.abandoned (a roll-back's record) marks ['s4', 's5'] abandoned"
    assert rc == 0 and [line.split()[0] for line in out.splitlines() if "abandoned" in line] == ["s4", "s5", "note:"]
    assert note in out.splitlines()
    assert json.loads(_run_cli("ls", root, "--json")[1])["abandoned_by"] == f"{root}/smpckpt.abandoned"


def test_a_crafted_root_record_abandoning_everything_is_named_by_the_refusal_and_ls(tmp_path: Any) -> None:
    """rev60c F5: a root file abandoning 1-99 of a save 100 (crafted: no such save) makes every checkpoint
    abandoned: the fallback's refusal and ``ls`` said so naming no file; both name smpckpt.abandoned."""
    root, ck = str(tmp_path), Checkpointer(str(tmp_path))
    for step in range(1, 4):
        ck.save(f"s{step}", *_model(step), user_content={"step": step})
    with open(os.path.join(root, "smpckpt.abandoned"), "w") as f:
        json.dump({"sequence": 100, "abandoned": [[1, 99]]}, f)
    _damage(root, "s3")
    with pytest.raises(CheckpointNotFound, match="every committed checkpoint was abandoned") as info:
        Checkpointer(root).resume(None, *_model(9))
    assert f"as {root}/smpckpt.abandoned records" in str(info.value)
    rc, out, _ = _run_cli("ls", root)
    assert rc == 0 and f"note: {root}/smpckpt.abandoned (a roll-back's record) marks ['s1', 's2'] abandoned" in out


def test_rollback_then_more_saves_and_a_tagless_restart_carries_the_record(tmp_path: Any) -> None:
    root = str(tmp_path)
    models = _rolled_back(root, keep=4, later=2)  # s6, s7
    ck = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=4))
    m, o = _model(0)
    assert ck.resume(None, m, o) == {"step": 7}
    ck.save("s8", m, o, user_content={"step": 8})
    assert read_manifest(os.path.join(root, "s8_partial")).extra["abandoned"] == [[4, 5]]
    # the four newest of the history stay, and s4, s5 (abandoned: never removed nor counted); s2 went
    assert _tags(root) == {t: "committed" for t in ("s3", "s4", "s5", "s6", "s7", "s8")}
    _damage(root, "s8")
    _damage(root, "s7")
    m, o = _model(9)
    with pytest.warns(UserWarning, match="checkpoint 's6' of the job's history"):
        assert Checkpointer(root).resume(None, m, o) == {"step": 6}
    _assert_same_params(models[6], m)


def _raising(sd: Any) -> Any:
    raise RuntimeError("translate_function failed")


def test_a_failed_resume_by_tag_is_no_rollback(tmp_path: Any) -> None:
    """rev60a F1: a resume by tag that fails (a raising translate_function; the model keeps s5's state)
    recorded a roll-back: the next save abandoned s4, s5 and retention removed them."""
    root = str(tmp_path)
    ck, models = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=3)), {}
    for step in range(1, 6):
        models[step], o = _model(step)
        ck.save(f"s{step}", models[step], o, user_content={"step": step})
    m = models[5]  # and o, its optimizer
    with pytest.raises(RuntimeError, match="translate_function failed"):
        ck.resume("s3", m, o, options=ResumeOptions(translate_function=_raising))
    ck.save("s6", m, o, user_content={"step": 6})
    assert "abandoned" not in read_manifest(os.path.join(root, "s6_partial")).extra
    assert _tags(root) == {t: "committed" for t in ("s4", "s5", "s6")}
    assert not os.path.exists(os.path.join(root, "smpckpt.abandoned"))
    m2, o2 = _model(9)
    assert Checkpointer(root).resume(None, m2, o2) == {"step": 6}
    _assert_same_params(models[5], m2)


def test_fallback_uses_the_root_record_when_every_save_after_the_rollback_is_damaged(tmp_path: Any) -> None:
    """rev60a F2: s6 (which wrote the root's record) and s7 damaged: the fallback took abandoned s5."""
    root = str(tmp_path)
    models = _rolled_back(root, keep=None, later=2)
    _damage(root, "s6")
    _damage(root, "s7")
    m, o = _model(9)
    with pytest.warns(UserWarning, match=r"checkpoint 's3' of the job's history \(not \['s5', 's4'\]"):
        assert Checkpointer(root).resume(None, m, o) == {"step": 3}
    _assert_same_params(models[3], m)


def test_an_export_after_a_rollback_still_leaves_the_root_record(tmp_path: Any) -> None:
    """rev60a F4: an export right after the roll-back drew its number: s7's range did not end at 6, so the
    root's record was never written, and s7 damaged made the fallback take abandoned s5."""
    root = str(tmp_path)
    ck, models = Checkpointer(root), {}
    for step in range(1, 6):
        models[step], o = _model(step)
        ck.save(f"s{step}", models[step], o, user_content={"step": step})
    ck2, (m, o) = Checkpointer(root), _model(0)
    ck2.resume("s3", m, o)
    ck2.export("f6", model=m, optimizer=o)
    ck2.save("s7", m, o, user_content={"step": 7})
    assert read_manifest(os.path.join(root, "s7_partial")).extra["abandoned"] == [[4, 5]]
    _damage(root, "s7")
    m2, o2 = _model(9)
    with pytest.warns(UserWarning, match="checkpoint 's3' of the job's history"):
        assert Checkpointer(root).resume(None, m2, o2) == {"step": 3}
    _assert_same_params(models[3], m2)


def test_two_models_checkpointers_in_one_root_never_delete_each_others_saves(tmp_path: Any) -> None:
    """rev60a F3: G and D alternate in one root; restarted, each resumes its own newest tag: each next save
    inferred the other's newest abandoned, and retention (keep=10) deleted g3 and d2."""
    root, keep = str(tmp_path), Retention(num_kept_partial_checkpoints=10)
    (g, og), (d, od) = _model(1), _model(2)
    cg, cd = Checkpointer(root, retention=keep), Checkpointer(root, retention=keep)
    for i in (1, 2):
        cg.save(f"g{i}", g, og, user_content={"g": i})
        cd.save(f"d{i}", d, od, user_content={"d": i})
    cg, cd = Checkpointer(root, retention=keep), Checkpointer(root, retention=keep)
    cg.resume("g2", g, og)
    cd.resume("d2", d, od)
    cg.save("g3", g, og, user_content={"g": 3})
    cd.save("d3", d, od, user_content={"d": 3})
    assert _tags(root) == {t: "committed" for t in ("g1", "g2", "g3", "d1", "d2", "d3")}
    g2, og2 = _model(9)
    assert Checkpointer(root).resume("g3", g2, og2) == {"g": 3}
    _assert_same_params(g, g2)


def test_a_rollback_to_an_unnumbered_checkpoint_records_everything_numbered(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev60a F7: a roll-back by tag to a 0.1.0-style (unnumbered) checkpoint recorded nothing; keep=2 then
    deleted it, the parent of the job's history. Its number is 0: s1..s3 are recorded (kept, uncounted)."""
    import smpckpt.api._save as save_mod

    root, real = str(tmp_path), save_mod.manifest_extra

    def unnumbered(*args: Any, **kwargs: Any) -> Any:
        extra = real(*args, **kwargs)
        extra.pop("sequence", None)
        return extra

    monkeypatch.setattr(save_mod, "manifest_extra", unnumbered)
    old, o = _model(0)
    Checkpointer(root).save("old", old, o, user_content={"step": 0})
    monkeypatch.setattr(save_mod, "manifest_extra", real)
    assert "sequence" not in read_manifest(os.path.join(root, "old_partial")).extra
    ck = Checkpointer(root)
    for step in (1, 2, 3):
        ck.save(f"s{step}", *_model(step), user_content={"step": step})
    ck2, (m, o) = Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=2)), _model(7)
    assert ck2.resume("old", m, o) == {"step": 0}
    _assert_same_params(old, m)
    ck2.save("s4", m, o, user_content={"step": 4})
    assert read_manifest(os.path.join(root, "s4_partial")).extra["abandoned"] == [[1, 3]]
    assert _tags(root) == {t: "committed" for t in ("old", "s1", "s2", "s3", "s4")}
    _damage(root, "s4")
    m2, o2 = _model(9)
    with pytest.warns(UserWarning, match="checkpoint 'old' of the job's history"):
        assert Checkpointer(root).resume(None, m2, o2) == {"step": 0}
    _assert_same_params(old, m2)


def test_prune_reads_the_root_record_like_the_fallback(tmp_path: Any) -> None:
    """rev60a F8: s6 (the roll-back's save) damaged: ``ls`` and the fallback read the root's record, prune
    did not: ``--keep 2`` deleted s1..s3 (the fallback's s3 among them) and the restart was refused."""
    root = str(tmp_path)
    models = _rolled_back(root, keep=None)
    _damage(root, "s6")
    rc, out, _ = _run_cli("prune", root, "--keep", "2")
    assert rc == 0 and out == "removed s1\n", out
    assert _tags(root) == {"s2": "committed", "s3": "committed", "s4": "committed", "s5": "committed", "s6": "corrupt"}
    m, o = _model(9)
    with pytest.warns(UserWarning, match="checkpoint 's3' of the job's history"):
        assert Checkpointer(root).resume(None, m, o) == {"step": 3}
    _assert_same_params(models[3], m)


@pytest.mark.parametrize("wrapper", ["checkpoint_wrapper", "DataParallel"])
def test_smp_face_carries_the_rollback_to_a_model_wrapped_whole(tmp_path: Any, wrapper: str) -> None:
    """hunt66c F3: as torch.compile's below, a model wrapped whole after a roll-back by checkpoint_wrapper or
    nn.DataParallel met no kept Checkpointer: a fresh one recorded no roll-back, and keep=2 removed s1, the
    checkpoint the job had resumed, keeping the abandoned s3."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    root = str(tmp_path)
    for step in range(1, 4):
        m, o = _model(step)
        save_checkpoint(root, f"s{step}", model=m, optimizer=o)
    m, o = _model(0)
    resume_from_checkpoint(root, tag="s1", model=m, optimizer=o)
    wrapped = checkpoint_wrapper(m) if wrapper == "checkpoint_wrapper" else nn.DataParallel(m)
    save_checkpoint(root, "s4", model=wrapped, optimizer=o, num_kept_partial_checkpoints=2)
    assert read_manifest(os.path.join(root, "s4_partial")).extra.get("abandoned") == [[2, 3]]
    assert _tags(root) == {t: "committed" for t in ("s1", "s2", "s3", "s4")}


@pytest.mark.parametrize("spelling", ["file-url", "link"])
def test_smp_face_carries_the_rollback_across_spellings_of_the_root(tmp_path: Any, spelling: str) -> None:
    """hunt72a F2: a roll-back resumed through a symbolic link to the root (saves through the root itself) met a
    kept Checkpointer of "another root": the new one adopted no roll-back, so keep=2 removed s1, the checkpoint the
    job had resumed, and kept the abandoned s3, which a fallback past a damaged s4 then resumed."""
    root = tmp_path / "run"
    root.mkdir()
    (tmp_path / "linked").symlink_to(root)
    spelled = {"file-url": f"file://{root}", "link": str(tmp_path / "linked")}[spelling]
    for step in range(1, 4):
        m, o = _model(step)
        save_checkpoint(str(root), f"s{step}", model=m, optimizer=o)
    m, o = _model(0)
    resume_from_checkpoint(spelled, tag="s1", model=m, optimizer=o)
    save_checkpoint(str(root), "s4", model=m, optimizer=o, num_kept_partial_checkpoints=2)
    assert read_manifest(os.path.join(root, "s4_partial")).extra.get("abandoned") == [[2, 3]]
    assert _tags(str(root)) == {t: "committed" for t in ("s1", "s2", "s3", "s4")}


def test_smp_face_passes_a_users_module_named_like_a_wrapper(tmp_path: Any) -> None:
    """rev66b R4: a user's own module merely named DataParallel or CheckpointWrapper (no inner attribute) made
    the smp face's unwrapping fail save and resume with AttributeError; it is the model, unwrapped no further."""
    for name in ("DataParallel", "CheckpointWrapper"):
        own = type(name, (nn.Module,), {})
        m = own()
        m.net = _model(1)[0]
        save_checkpoint(str(tmp_path), name, model=m, optimizer=torch.optim.AdamW(m.parameters()))
        m2 = own()
        m2.net = _model(2)[0]
        resume_from_checkpoint(str(tmp_path), name, model=m2, optimizer=torch.optim.AdamW(m2.parameters()))
        _assert_same_params(m, m2)


def test_smp_face_carries_the_rollback_to_a_replaced_or_wrapped_checkpointer(tmp_path: Any) -> None:
    """rev60a F9 and F6: a resume by tag with other options (AsyncOptions) than the save's replaces the kept
    Checkpointer (``SequenceCounter.adopt`` carries the roll-back over); a model wrapped after the resume
    (torch.compile) meets the Checkpointer its inner module keeps."""
    for i, wrap in enumerate((lambda m: m, torch.compile)):
        root, saved = str(tmp_path / f"r{i}"), {}
        for step in range(1, 6):
            saved[step], o = _model(step)
            save_checkpoint(root, f"s{step}", model=saved[step], optimizer=o, user_content={"step": step})
        m, o = _model(0)
        back = resume_from_checkpoint(root, tag="s3", model=m, optimizer=o, options=AsyncOptions(enabled=True))
        assert back == {"step": 3}
        _assert_same_params(saved[3], m)
        save_checkpoint(root, "s6", model=wrap(m), optimizer=o, num_kept_partial_checkpoints=2)
        assert read_manifest(os.path.join(root, "s6_partial")).extra["abandoned"] == [[4, 5]], wrap
        assert _tags(root) == {t: "committed" for t in ("s3", "s4", "s5", "s6")}
