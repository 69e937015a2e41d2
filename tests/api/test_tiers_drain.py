"""The fast tier's drain to ``path``: failures, damaged fast-tier files (checked as they are copied, from a
peer's replica when one is intact), S3, late drains and retention."""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import tier_jobs_workers
import torch
from dist_harness import run_world
from tier_helpers import job as _job
from tier_helpers import linear as _linear
from tier_helpers import partials as _partials
from tier_helpers import same as _same
from torch import nn

from smpckpt import (
    Checkpointer,
    CheckpointError,
    FastTier,
    Location,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.storage.format.manifest import MANIFEST_NAME


def _first_drain_disk_full(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The first file a drain opens in ``path`` fails as a full disk; the calls seen, listed."""
    import smpckpt.api._drain as drain_module

    real, calls = drain_module.open_sink, []

    def disk_full_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(28, "injected: no space left on the durable storage")
        return real(*args, **kwargs)

    monkeypatch.setattr(drain_module, "open_sink", disk_full_once)
    return calls


def test_a_drain_that_fails_leaves_no_empty_folder_in_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain failing mid-copy (the durable storage's disk full) removed the files it had copied but left
    an empty ``<tag>_partial/`` in ``path``: debris no tool cleaned and ``ls`` showed. Removed when empty
    now; the fast tier still holds the tag, and the next save drains."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    calls = _first_drain_disk_full(monkeypatch)
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1)
    with pytest.raises(CheckpointError, match="no space left on the durable storage; it is still in the fast tier"):
        wait_for_saves()
    assert calls and sorted(p.name for p in durable.iterdir() if p.name.startswith("s1")) == []
    got = _linear(9)
    resume_from_checkpoint(durable, tag="s1", model=got, local_path=local)
    assert _same(got, m1)
    save_checkpoint(durable, "s2", model=m2, local_path=local, replicas=1)
    wait_for_saves()
    assert (durable / "s2_partial" / MANIFEST_NAME).is_file()


def test_a_failed_drain_another_checkpointer_drained_again_is_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev68i: each save with a new model object (a Checkpointer per save): s2's drain failed, s3's
    Checkpointer drained s2 again and committed it, and wait_for_saves still raised s2's failure (the first
    Checkpointer kept it). Healed: not raised; path holds s2 bit-exactly. A failure not healed is still raised
    (the test above)."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    calls = _first_drain_disk_full(monkeypatch)
    models = {s: _linear(s) for s in (1, 2, 3)}
    tier = FastTier(local_path=str(local), replicas=1, durable_every=2)
    for s in (1, 2, 3):  # s2 due, its drain fails; s3 (not due) drains it again
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # s3's retry is warned about: tested elsewhere
            save_checkpoint(durable, f"s{s}", model=models[s], options=tier)
        if s == 2:  # s3 is planned once s2's drain failed (one in flight is not drained again); kept, not raised
            wait_for_saves(raise_errors=False)
    wait_for_saves()
    assert len(calls) > 1 and (durable / "s2_partial" / MANIFEST_NAME).is_file()
    got = _linear(9)
    resume_from_checkpoint(durable, tag="s2", model=got)
    assert _same(got, models[2])


def test_a_drain_never_commits_a_damaged_fast_tier_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte of a fast-tier data file changed between the save and its drain (a failing disk): the drain
    copied it unchecked, committed it as the durable copy and pointed ``newest`` at it -- and the fast
    tier's retention would then remove the intact copies (a peer's replica). Each file is checked against
    its manifest's block checksums as it is copied: the drain fails, ``path`` holds nothing of it."""
    import smpckpt.api._drain as drain_module

    durable, local = tmp_path / "durable", tmp_path / "fast"
    real, flipped = drain_module.check_blocks, []

    def damaged_first(fs: Any, fpath: str, *args: Any, **kwargs: Any) -> bool:
        if not flipped:
            target = Path(fpath)
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0xFF
            target.write_bytes(bytes(data))
            flipped.append(target.name)
        return bool(real(fs, fpath, *args, **kwargs))

    monkeypatch.setattr(drain_module, "check_blocks", damaged_first)
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1)
    with pytest.raises(CheckpointError, match=r"the drain of 's1' copies nothing damaged: .*checksum mismatch"):
        wait_for_saves()
    assert flipped and sorted(p.name for p in durable.iterdir()) == []  # no copy, no newest
    assert (_job(local, durable) / "s1_partial" / MANIFEST_NAME).is_file()  # the fast tier keeps the save


@pytest.mark.dist
def test_failed_drains_do_not_pile_up_in_the_fast_tier(tmp_path: Path) -> None:
    """hunt64c F3: ``path`` full, every drain failing (durable_every=1, num_kept_local=1): the fast tier kept
    every save whose drain failed, though only the newest is ever drained again, until the node's disk was
    full and every save failed. Now it keeps num_kept_local, the tag just saved, one a drain copies and the
    pending drain a retry would pick (here the newest; in a second job an older one, the newest being
    undrainable), and warns of each failed drain it removes. The newest resumes bit-exactly; with room in
    ``path`` again, a save not due for it drains that one again, and ``path`` resumes it bit-exactly."""
    results = run_world(tier_jobs_workers.failed_drains_pile_up, 2, str(tmp_path), timeout=240)
    for rank, got in enumerate(results):
        for step, said in enumerate(got["wait"], 1):
            assert said.startswith(f"CheckpointError: the drain of checkpoint 'step{step}'"), (rank, said)
            assert "injected: no space left on path's storage" in said, (rank, said)
        for step, held in enumerate(got["fast"], 1):
            assert len(held) <= 1 + 2 and f"step{step}_partial" in held, (rank, step, got["fast"])  # before: all
        assert got["fast"][-1] == ["step5_partial"], (rank, got["fast"])
        for step in range(1, 5):  # each node's first rank removed each older failed drain, naming it
            said = [m for m in got["logged"] if f"removed checkpoint 'step{step}' (save {step})" in m]
            assert len(said) == 1 and "never reached" in said[0] and "/durable" in said[0], (rank, got["logged"])
            assert f"'step{step + 1}' (save {step + 1}), newer, is drained instead" in said[0], said
        resumed = got["resumed"]
        assert resumed.startswith("ok {'tag': 'step5', 'tier': 'fast'"), (rank, resumed)
        assert "'uc': {'step': 5}, 'exact': True}" in resumed, (rank, resumed)
        assert (got["save6"], got["wait6"]) == ("ok None", "ok None"), (rank, got)
        assert got["durable"] == ["newest", "step5_partial"] and got["fast6"] == ["step6_partial"], (rank, got)
        from_path = got["from_path"]
        assert from_path.startswith("ok {'tag': 'step5', 'tier': 'durable'"), (rank, from_path)
        assert "'uc': {'step': 5}, 'exact': True}" in from_path, (rank, from_path)
        # the newest pending drain cannot be drained (a part lost on both nodes): the one the retry picks stays
        assert got["fast2"] == ["step2_partial", "step5_partial"], (rank, got["fast2"])  # before: step4 too
        said = [m for m in got["logged2"] if "removed checkpoint 'step4' (save 4)" in m]
        assert len(said) == 1 and "/durable2; 'step2' (save 2) is drained instead" in said[0], (rank, got["logged2"])
    assert any("'step5' (save 5)" in w for w in results[0]["said6"]), results[0]["said6"]


class _SpySink:
    """A drain's sink as it is, counting the bytes handed to it and whether it was aborted."""

    def __init__(self, sink: Any, seen: dict[str, int]) -> None:
        self.sink, self.seen, self.borrows = sink, seen, sink.borrows

    def write(self, data: memoryview) -> None:
        self.seen["written"] += len(data)
        self.sink.write(data)

    def commit(self) -> None:
        self.sink.commit()

    def abort(self) -> None:
        self.seen["aborted"] += 1
        self.sink.abort()


def _damage_late_in_the_first_file_drained(monkeypatch: pytest.MonkeyPatch, seen: dict[str, int]) -> None:
    """Before the drain reads its first file, a byte of its last block changes; every sink is spied on."""
    import threading

    import smpckpt.api._drain as drain_module

    real_check, real_open, lock = drain_module.check_blocks, drain_module.open_sink, threading.Lock()

    def damaged_first(fs: Any, fpath: str, rec: Any, *args: Any, **kwargs: Any) -> bool:
        with lock:  # the drain copies several files at once
            if not seen["flipped"]:
                target = Path(fpath)
                data = bytearray(target.read_bytes())
                data[rec.block_ends[-1] - 3] ^= 0xFF
                target.write_bytes(bytes(data))
                seen["flipped"] = 1
        return bool(real_check(fs, fpath, rec, *args, **kwargs))

    monkeypatch.setattr(drain_module, "check_blocks", damaged_first)
    monkeypatch.setattr(drain_module, "open_sink", lambda *a, **kw: _SpySink(real_open(*a, **kw), seen))


def test_a_drain_failing_while_the_next_save_is_written_stays_for_the_save_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65b F1: save 4's drain (due, durable_every=4) was still running when save 5 was planned, so save 5
    chose no retry; the drain then failed, and save 5's retention removed step4 as an older failed drain:
    save 6 had nothing to drain and `path` got nothing. The save whose drain was running when save 5 was planned stays now (fix65b)."""
    import threading

    import smpckpt.api._drain as drain_module
    import smpckpt.api._fast_save as fast_save

    durable, local = tmp_path / "durable", tmp_path / "fast"
    real_sink, real_run, down, release = drain_module.open_sink, fast_save.run_save, [True], threading.Event()

    def path_full(*args: Any, **kwargs: Any) -> Any:
        if down[0]:
            assert release.wait(60)  # the drain fails once save 5 is planned and writing
            raise OSError(28, "injected: no space left on path")
        return real_sink(*args, **kwargs)

    def run_save(*args: Any, **kwargs: Any) -> Any:
        if args[1].tag == "step5":
            release.set()
            with pytest.raises(CheckpointError, match="no space left on path"):
                wait_for_saves()  # step4's drain has failed before step5 commits and retains
        return real_run(*args, **kwargs)

    monkeypatch.setattr(drain_module, "open_sink", path_full)
    monkeypatch.setattr(fast_save, "run_save", run_save)
    tier, model = FastTier(local_path=str(local), replicas=1, durable_every=4, num_kept_local=1), _linear(1)
    for k in range(1, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(durable, f"step{k}", model=model, options=tier)
        if k != 4:
            wait_for_saves()
        if k == 4:
            saved = _linear(4)
            saved.load_state_dict(model.state_dict())
    assert "step4_partial" in _partials(_job(local, durable)), _partials(_job(local, durable))
    down[0] = False
    save_checkpoint(durable, "step6", model=model, options=tier)  # not due: drains step4 again
    wait_for_saves()
    got = _linear(9)
    resume_from_checkpoint(durable, tag="step4", model=got)  # from path alone (no local_path)
    assert (durable / "step4_partial" / MANIFEST_NAME).is_file() and _same(got, saved)


def test_a_retry_failing_while_the_next_save_is_written_stays_though_a_newer_failed_drain_is_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65d F1: path down for saves 1-8 (durable_every=4), a roll-back to step6 abandons step8; save 9b
    drains step4 again, and that drain fails while save 10b is written. Save 10b's retention kept the newest
    complete failed drain, step8 (which can never be drained), and removed step4: path got nothing until
    save 12b. Now the save whose drain was running when 10b was planned stays, and save 11b drains it."""
    import threading

    import smpckpt.api._drain as drain_module
    import smpckpt.api._fast_save as fast_save

    durable, local = tmp_path / "durable", tmp_path / "fast"
    real_sink, real_run, mode, release = drain_module.open_sink, fast_save.run_save, ["down"], threading.Event()

    def path_full(*args: Any, **kwargs: Any) -> Any:
        if mode[0] != "up":
            assert mode[0] == "down" or release.wait(60)  # "slow": fails once save 10b is planned and writing
            raise OSError(28, "injected: no space left on path")
        return real_sink(*args, **kwargs)

    def run_save(*args: Any, **kwargs: Any) -> Any:
        if args[1].tag == "step10b":
            release.set()
            with pytest.raises(CheckpointError, match="'step4'.*no space left on path"):
                wait_for_saves()  # step4's drain again has failed before step10b commits and retains
            mode[0] = "up"
        return real_run(*args, **kwargs)

    monkeypatch.setattr(drain_module, "open_sink", path_full)
    monkeypatch.setattr(fast_save, "run_save", run_save)
    tier, model = FastTier(local_path=str(local), replicas=1, durable_every=4, num_kept_local=5), _linear(1)
    for k in range(1, 9):
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(durable, f"step{k}", model=model, options=tier)
        if k < 4:
            wait_for_saves()
            continue
        with pytest.raises(CheckpointError, match="no space left on path"):
            wait_for_saves()  # step4's drain, then its retries by saves 5-7, then step8's
        if k == 4:
            saved = _linear(4)
            saved.load_state_dict(model.state_dict())
    resume_from_checkpoint(durable, tag="step6", model=model, options=FastTier(local_path=str(local)))
    assert (last_resume_info().tag, last_resume_info().tier) == ("step6", "fast")
    mode[0] = "slow"
    for k in range(9, 12):
        with pytest.warns(UserWarning) as said:
            save_checkpoint(durable, f"step{k}b", model=model, options=tier)
        text = [str(w.message) for w in said]
        kept = "abandoned by the roll-back to 'step6' (save 6); the fast tier keeps it (abandoned: retention neither"
        assert any("'step8' (save 8)" in m and kept in m for m in text), text  # never removed (fix72e)
        assert any("'step4' (save 4)" in m and "drains it to" in m for m in text) == (k != 10), (k, text)
        if k == 10:
            assert "step4_partial" in _partials(_job(local, durable)), _partials(_job(local, durable))
    wait_for_saves()
    assert (durable / "newest").read_text().strip() == "step4"
    got = _linear(9)
    resume_from_checkpoint(durable, tag="step4", model=got)  # from path alone (no local_path)
    assert _same(got, saved)


def test_no_save_older_than_a_running_drain_is_drained_again_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65b F3: path down for saves 1-3 (durable_every=2: step2's drain failed); step4's drain still ran
    when save 5 was planned, so save 5 drained step2 again, after step4: path's `newest` went back to step2.
    Now save 5 drains nothing again, and path's newest is step4, resumed bit-exactly."""
    import threading

    import smpckpt.api._drain as drain_module
    import smpckpt.api._fast_save as fast_save

    durable, local = tmp_path / "durable", tmp_path / "fast"
    real_sink, real_run, down, release = drain_module.open_sink, fast_save.run_save, [True], threading.Event()

    def path_slow(*args: Any, **kwargs: Any) -> Any:
        if down[0]:
            raise OSError(28, "injected: no space left on path")
        assert release.wait(60)  # step4's drain runs until save 5 is planned
        return real_sink(*args, **kwargs)

    def run_save(*args: Any, **kwargs: Any) -> Any:
        if args[1].tag == "step5":
            release.set()
        return real_run(*args, **kwargs)

    monkeypatch.setattr(drain_module, "open_sink", path_slow)
    monkeypatch.setattr(fast_save, "run_save", run_save)
    tier, model = FastTier(local_path=str(local), replicas=1, durable_every=2, num_kept_local=3), _linear(1)
    for k in range(1, 4):
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(durable, f"step{k}", model=model, options=tier)
        if k == 1:
            wait_for_saves()
            continue
        with pytest.raises(CheckpointError, match="'step2'.*no space left on path"):
            wait_for_saves()  # step2's drain, then save 3's drain of it again
    down[0] = False
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(durable, "step4", model=model, options=tier)
    saved = _linear(4)
    saved.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        save_checkpoint(durable, "step5", model=model, options=tier)
    wait_for_saves()
    assert (durable / "newest").read_text().strip() == "step4"  # before: step2
    assert sorted(p.name for p in durable.iterdir()) == ["newest", "step4_partial"]
    assert not any("drains it to" in str(w.message) for w in said), [str(w.message) for w in said]
    got = _linear(9)
    resume_from_checkpoint(durable, model=got)
    assert last_resume_info().tag == "step4" and _same(got, saved)


def test_the_drain_reads_each_file_once_and_removes_a_copy_found_damaged_mid_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain read each fast-tier file twice, the check and then the copy (+50 % drain time): now once,
    each run of blocks written to ``path`` once its checksums matched. A mismatch further on (here in the
    last block, after most of the file was written) aborts the partial durable file: nothing of the save
    in ``path``; the fast tier keeps it."""
    import builtins

    import smpckpt.storage.tools as tools

    durable, local = tmp_path / "durable", tmp_path / "fast"
    monkeypatch.setattr(tools, "_READ_CHUNK", 64 << 10)  # a 1 MiB file is checked (and copied) in 16 runs
    real_open, opened = builtins.open, []

    def counting(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file).startswith(str(local)) and str(file).endswith(".distcp") and "r" in mode:
            opened.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    torch.manual_seed(3)
    m1, m2 = nn.Linear(512, 512), nn.Linear(512, 512)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1)
    wait_for_saves()
    names = [n for n in os.listdir(durable / "s1_partial") if n.endswith(".distcp")]
    assert sorted(Path(p).name for p in opened) == sorted(names) and names, opened  # one read per file
    monkeypatch.setattr(builtins, "open", real_open)
    got = nn.Linear(512, 512)
    resume_from_checkpoint(durable, model=got)  # path alone: bit-exact
    assert _same(got, m1)

    seen = {"written": 0, "aborted": 0, "flipped": 0}
    _damage_late_in_the_first_file_drained(monkeypatch, seen)
    save_checkpoint(durable, "s2", model=m2, local_path=local, replicas=1)
    with pytest.raises(CheckpointError, match=r"the drain of 's2' copies nothing damaged: .*checksum mismatch"):
        wait_for_saves()
    assert seen["flipped"] and seen["aborted"] == 1 and seen["written"] >= 1 << 19, seen  # half written first
    assert sorted(p.name for p in durable.iterdir()) == ["newest", "s1_partial"]  # nothing of s2
    assert (_job(local, durable) / "s2_partial" / MANIFEST_NAME).is_file()  # the fast tier keeps it


def test_a_drain_to_s3_found_damaged_mid_way_aborts_its_upload(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 as ``path``: the copy of a file found damaged after a part was uploaded aborts its multipart
    upload (none left billing) and leaves no object of the save."""
    import s3fs

    import smpckpt.api._drain as drain_module
    import smpckpt.storage.tools as tools
    from smpckpt.storage.backends._sinks import MIN_PART_SIZE

    root, options = s3_root
    monkeypatch.setattr(tools, "_READ_CHUNK", 1 << 20)
    monkeypatch.setattr(drain_module, "_PART", MIN_PART_SIZE)  # a part is uploaded before the last block
    seen = {"written": 0, "aborted": 0, "flipped": 0}
    _damage_late_in_the_first_file_drained(monkeypatch, seen)
    torch.manual_seed(4)
    save_checkpoint(
        root, "s1", model=nn.Linear(1536, 1536), local_path=tmp_path / "fast", replicas=1, storage_options=options
    )
    with pytest.raises(CheckpointError, match=r"the drain of 's1' copies nothing damaged: .*checksum mismatch"):
        wait_for_saves()
    assert seen["flipped"] and seen["aborted"] == 1 and seen["written"] > MIN_PART_SIZE, seen
    fs = s3fs.S3FileSystem(**options)
    bucket, prefix = root[len("s3://") :].split("/", 1)
    assert fs.find(f"{bucket}/{prefix}/s1_partial") == []
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []


def test_a_drain_finishing_after_two_more_saves_removes_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain's fast-tier retention decides on the listing gathered before the save it drains; saves
    committed while it copied were in no listing and passed for uncommitted debris older than the newest
    commit: s4 (within num_kept_local=2) was removed when s3's drain ended after s5. The fifth save reuses
    the tag ``s1`` (removed by the fourth's retention): the listing's old ``s1`` stood for it, and the
    newest save was removed (rev58b F1). Held here by ``publish_newest`` waiting until both committed."""
    import threading

    import smpckpt.api._drain as drain_module

    durable, release = tmp_path / "durable", threading.Event()
    real = drain_module.publish_newest

    def held(*args: Any, **kwargs: Any) -> Any:
        if not release.wait(60):
            raise RuntimeError("the test never released the drain")
        return real(*args, **kwargs)

    monkeypatch.setattr(drain_module, "publish_newest", held)
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=3, num_kept_local=2)
    models = {s: _linear(s) for s in range(1, 6)}
    with Checkpointer(durable, fast_tier=fast) as c:
        for s in range(1, 6):
            c.save(f"s{s % 5 or 1}" if s == 5 else f"s{s}", models[s])  # the fifth: tag s1 again
            if s < 3:
                c.wait()
        release.set()
        c.wait()
    assert _partials(_job(Path(fast.local_path), durable)) == ["s1_partial", "s3_partial", "s4_partial"]
    got, newest = _linear(9), _linear(9)
    with Checkpointer(durable, fast_tier=fast) as c:
        c.resume(tag="s4", model=got)
        assert c.last_resume_info is not None and c.last_resume_info.tier == "fast"
        c.resume(model=newest)
        assert c.last_resume_info is not None and c.last_resume_info.tag == "s1"
    assert _same(got, models[4]) and _same(newest, models[5])


def test_the_drain_takes_each_file_from_its_writer_then_from_a_replica_node_not_tried() -> None:
    """(pure logic, rev58b F6) 3 nodes x 2 ranks, replicas=2: node n holds its own ranks' files and node
    n - 1's. A file goes to the rank that wrote it; once its node's copy failed, to the least loaded rank of
    the other node holding it (never the writer's node again); once both failed, to nobody."""
    from smpckpt.api._drain import copiers, holders_of
    from smpckpt.api._tiers import Nodes
    from smpckpt.storage.format.manifest import FileRecord

    files = [FileRecord(f"r{r}", 10, r, (10,), (0,)) for r in range(6)]
    holders = holders_of(files, Nodes(2, 6, 0), 2, None)
    assert holders["r0"] == (0, 1, 2, 3) and holders["r5"] == (0, 1, 4, 5), holders
    assert copiers(files, holders, 2) == {f"r{r}": r for r in range(6)}
    assert copiers(files[:2], holders, 2, {"r0": {0}, "r1": {0}}) == {"r0": 2, "r1": 3}  # spread over node 1
    assert copiers(files[:1], holders, 2, {"r0": {0, 1}}) == {}
    retried = {"r4": (4, 5)}  # a retried drain: the listing's holders (node 2 only)
    assert copiers(files[4:5], retried, 2) == {"r4": 4} and copiers(files[4:5], retried, 2, {"r4": {2}}) == {}


def test_the_drain_to_s3_sends_the_fast_tier_files_without_copying_them_into_part_buffers(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain's reads of fast-tier files are fresh immutable bytes: the S3 sink sends them as they
    are. It copied each into a part buffer of its own (copy mode): a second 32 MiB per file, 16 files
    at once (+1.07 GiB peak RSS per rank draining 528 MiB per rank to S3; +0.80 GiB without the copy)."""
    import threading

    from smpckpt.storage.backends._s3 import S3MultipartSink

    made: list[str] = []
    real = S3MultipartSink._next_buffer

    def counted(self: S3MultipartSink) -> bytearray:
        made.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(S3MultipartSink, "_next_buffer", counted)
    root, options = s3_root
    m1 = _linear(1)
    save_checkpoint(root, "s1", model=m1, local_path=tmp_path / "fast", replicas=1, storage_options=options)
    wait_for_saves()
    assert [n for n in made if n.startswith("smpckpt-drain-copy")] == []
    got = _linear(9)
    resume_from_checkpoint(root, model=got, storage_options=options, local_path=tmp_path / "empty")
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "durable")
    assert _same(got, m1)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_drain_holds_at_most_drain_memory_of_its_files_at_once(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing capped the drain's host memory: 4 files at once to filesystems, 16 to object stores, each with
    a read of up to 16 MiB and (S3) up to 3 parts of 32 MiB held, +0.8 GiB per rank to S3 (6-8 GiB for 8
    ranks of a node). Now a budget (``FastTier.drain_memory``) counts the bytes read and not yet let go: at
    most the cap at once (scaled down here: 1 MiB reads, 5 MiB parts), the copy still bit-exact and committed."""
    import smpckpt.api._drain as drain_module
    import smpckpt.storage.tools as tools
    from smpckpt.storage.backends._sinks import MIN_PART_SIZE

    budgets: list[Any] = []

    class Counted(drain_module._Budget):
        def __init__(self, cap: int, room: int) -> None:
            super().__init__(cap, room)
            budgets.append(self)

    monkeypatch.setattr(drain_module, "_Budget", Counted)
    monkeypatch.setattr(tools, "_READ_CHUNK", 1 << 20)
    monkeypatch.setattr(drain_module, "_PART", MIN_PART_SIZE)
    url, options = request.getfixturevalue("s3_root") if where == "s3" else (str(tmp_path / "durable"), None)
    root = Location(url, storage_options=options)
    cap = (2 << 20) if where == "local" else (20 << 20)  # local: 2 reads; S3: one file's 16 MiB and a read more
    torch.manual_seed(5)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))  # 48 MiB
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, drain_memory=cap)
    save_checkpoint(root, "s1", model=model, options=fast)
    wait_for_saves()
    (budget,) = budgets
    assert (budget.cap, budget.held, budget.files) == (cap, 0, {})  # every byte taken was given back
    assert 1 << 20 <= budget.peak <= cap, (budget.peak, cap)
    got = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))
    resume_from_checkpoint(root, model=got, options=FastTier(local_path=str(tmp_path / "empty")))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "durable")  # committed in path
    assert _same(got, model)
    with pytest.raises(ValueError, match=r"drain_memory must be >= 1048576, got 1000"):
        FastTier(local_path=str(tmp_path / "fast"), drain_memory=1000)


def test_the_drain_budget_keeps_room_for_its_oldest_file_which_never_waits() -> None:
    """A file waits while taking would pass the cap with room kept for the oldest file still copying; that
    one never waits (a cap below a file's need copies a file at a time, not none: no deadlock with every
    file holding half a part), and a file's end gives back whatever it still held."""
    import threading

    from smpckpt.api._drain import _Budget

    budget = _Budget(cap=10, room=4)
    budget.take("a", 3)
    budget.take("b", 3)  # 6 held, 1 more kept for a: 7 <= 10
    waiting = threading.Thread(target=budget.take, args=("c", 4))  # 10 + a's 1 > 10: waits
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and budget.held == 6
    budget.take("a", 20)  # the oldest file: past the cap, never waiting
    assert (budget.held, budget.peak) == (26, 26)
    budget.end("a")  # b is the oldest now; c fits beside it
    waiting.join(5)
    assert not waiting.is_alive() and budget.files == {"b": 3, "c": 4} and budget.held == 7
    budget.give("b", 3)
    budget.give("gone", 5)  # a part sent after its file ended: nothing to give back
    budget.end("b")
    budget.end("c")
    assert (budget.held, budget.files, budget.peak) == (0, {}, 26)


def test_a_child_forked_while_the_job_record_is_locked_does_not_hold_the_next_note(tmp_path: Path) -> None:
    """rev72m: the record's ``flock`` was left to the descriptor's close, and a child forked while it was held (a
    DataLoader worker) kept a copy of the descriptor: the next note (the save thread's ``note_seen``, every other
    rank in a collective behind it) waited until that child exited."""
    import smpckpt.api._drain as drain_module

    job = str(tmp_path)
    with drain_module._record_locked(job):
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only holds the descriptor, then leaves
            time.sleep(8)
            os._exit(0)
    try:
        started = time.monotonic()
        drain_module.note_drained(job, "c1", "id1")
        waited = time.monotonic() - started
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert waited < 4, waited  # 8 s: held until the child exits
    assert drain_module.read_drained(job) == {"c1": "id1"}
    assert os.stat(os.path.join(job, drain_module.JOB_DRAINED)).st_mode & 0o777 == 0o644


def test_a_drain_and_a_save_noting_path_at_once_both_stay_in_the_job_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """rev72e LOW-1: the drain thread's ``note_drained`` and the save thread's ``note_seen`` each read the job
    folder's record, changed it and replaced it through one temp file named by the pid: both read the old
    record, the later replace dropped the other's tag (a drained tag lost: 98 in 3000 rounds), or the two
    wrote one temp file (a record read as empty: 31). Now one at a time (``flock`` of the job folder), each
    through a temp file of its own. Each write is slowed so the two always overlap."""
    import json
    import threading
    import types

    import smpckpt.api._drain as drain_module

    def slow_dumps(value: Any) -> str:
        time.sleep(0.05)  # between the read and the replace: both threads read the old record, every round
        return json.dumps(value)

    monkeypatch.setattr(drain_module, "json", types.SimpleNamespace(loads=json.loads, dumps=slow_dumps))
    job = str(tmp_path)
    for i in range(5):
        (tmp_path / drain_module.JOB_DRAINED).write_text('{"drained": ["c1"], "ids": {"c1": "id1"}}')
        start = threading.Barrier(2)

        def drainer(start: threading.Barrier = start) -> None:
            start.wait()
            drain_module.note_drained(job, "c3", "id3")

        def saver(start: threading.Barrier = start) -> None:
            start.wait()
            drain_module.note_seen(job, ("x9", "idx"))

        threads = [threading.Thread(target=drainer), threading.Thread(target=saver)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(drain_module.read_drained(job).items()) == [("c1", "id1"), ("c3", "id3"), ("x9", "idx")], i
        assert sorted(os.listdir(job)) == [drain_module.JOB_DRAINED], i  # no temp file left
    assert not [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
