"""Tiered checkpoints (``local_path=``): 2 simulated nodes x 2 gloo ranks (``LOCAL_WORLD_SIZE=2``), each
node's fast tier its own folder; kills during replication and during the drain; a changed world; the
options refused by name. Single-process cases (one node, ``replicas=1``) first: they are cheap."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import tier_jobs_workers
import tier_workers
import torch
import xxhash
from dist_harness import RankFailed, run_world
from torch import nn

from smpckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointExists,
    DrainStatus,
    FastTier,
    LayoutMismatch,
    drain_status,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME


def _linear(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 8)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _job(local: Path, durable: Path | str) -> Path:
    """The job folder of the durable root ``durable`` in the fast tier ``local``."""
    return Path(job_folder(str(local), durable_key(str(durable), None)))


def _partials(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith("_partial"))


def _tier_record(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "smpckpt.manifest.json").read_text())["extra"]["tier"]


# -- one process, one node ---------------------------------------------------------------------------
def test_one_node_saves_drains_every_second_and_resumes_newest(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    local = _job(fast, durable)
    models = {}
    for step in range(1, 4):
        models[step] = _linear(step)
        save_checkpoint(durable, f"s{step}", model=models[step], local_path=fast, replicas=1, durable_every=2)
    wait_for_saves()
    assert drain_status() == DrainStatus("s2", "done")
    assert _partials(local) == ["s2_partial", "s3_partial"]  # num_kept_local=2
    assert sorted(os.listdir(durable)) == ["newest", "s2_partial"]
    assert (durable / "newest").read_text().strip() == "s2"
    assert [_tier_record(local / f"s{s}_partial")["seq"] for s in (2, 3)] == [2, 3]
    s2_record = _tier_record(durable / "s2_partial")
    # each save names the saves it was numbered after by their manifests' digests (s1's: gone by now)
    s1_digest = s2_record.pop("lineage")
    assert len(s1_digest) == 1 and len(s1_digest[0]) == 16
    s2_manifest = (local / "s2_partial" / "smpckpt.manifest.json").read_bytes()
    assert _tier_record(local / "s3_partial")["lineage"] == [
        f"{xxhash.xxh3_64_intdigest(s2_manifest):016x}",
        *s1_digest,
    ]
    assert s2_record == {
        "seq": 2,
        "durable": True,
        "replicas": 1,
        "nodes": 1,
        "local_world_size": 1,
        "root": durable_key(str(durable), None),  # the durable root this copy belongs to
        "path_seen": 0,  # path held nothing when s2 was planned (s1 was not due for it)
    }
    # the durable copy is the fast tier's, byte for byte (drained from its files)
    for name in os.listdir(local / "s2_partial"):
        assert (durable / "s2_partial" / name).read_bytes() == (local / "s2_partial" / name).read_bytes()

    got = _linear(99)
    resume_from_checkpoint(durable, model=got, local_path=fast)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier, info.from_peers) == ("s3", "fast", ())
    assert _same(got, models[3])

    # a restart (nothing cached) keeps counting from the saves already there: s4 is save 4, durable
    models[4] = _linear(4)
    save_checkpoint(durable, "s4", model=models[4], local_path=fast, replicas=1, durable_every=2)
    wait_for_saves()
    assert _tier_record(durable / "s4_partial")["seq"] == 4

    for name in _partials(local):  # the whole fast tier lost: the newest durable checkpoint
        (local / name).rename(tmp_path / f"gone-{name}")
    got = _linear(98)
    resume_from_checkpoint(durable, model=got, local_path=fast)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s4", "durable")
    assert _same(got, models[4])


def test_corrupt_fast_copy_falls_back_to_the_next_one_then_the_durable_one(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    local = _job(fast, durable)
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=fast, replicas=1)
    save_checkpoint(durable, "s2", model=m2, local_path=fast, replicas=1, durable_every=1)
    wait_for_saves()
    data = [p for p in (local / "s2_partial").iterdir() if p.name.endswith(".distcp")]
    raw = bytearray(data[0].read_bytes())
    raw[-1] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # the durable s2 is gone too: s1 there
    for tier in ("fast", "durable"):  # the fast tier's s1 next; without it, path's s1
        got = _linear(99)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume_from_checkpoint(durable, model=got, local_path=fast)
        said = [str(w.message) for w in caught]
        assert any("'s2' has corrupt parts" in m and "no node holds an intact copy" in m for m in said), said
        assert any("'s2' from the fast tier failed" in m for m in said), said  # the fast copy, then ...
        assert any("newest names 's2', which is not a committed" in m for m in said), said  # ... path's newest
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("s1", tier)
        assert _same(got, m1)
        if tier == "fast":
            shutil.rmtree(local / "s1_partial")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 3}, "replicas apply only with local_path"),
        ({"durable_every": 3, "num_kept_local": 1}, "durable_every, num_kept_local apply only with local_path"),
        ({"local_path": "s3://bucket/x"}, "not a URL"),
        ({"local_path": "LOCAL", "replicas": 2}, "replicas=2 needs 2 nodes, this job has 1"),
        ({"local_path": "LOCAL", "replicas": 0}, "replicas must be >= 1"),
        ({"local_path": "LOCAL", "durable_every": 0}, "durable_every must be >= 1"),
        ({"local_path": "LOCAL", "overwrite": True}, "overwrite does not apply with local_path"),
        ({"local_path": "LOCAL", "partial": False}, "local_path applies only to partial checkpoints"),
    ],
)
def test_tier_options_refused_by_name(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    kwargs = {k: str(tmp_path / "fast") if v == "LOCAL" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path / "durable", "t", model=_linear(0), **kwargs)
    assert not (tmp_path / "durable").exists() and not (tmp_path / "fast").exists()


def test_local_path_apart_from_path_and_a_folder_refused_by_name(tmp_path: Path) -> None:
    """(one process) ``local_path`` equal to ``path``, inside it or containing it; a file; a folder
    that cannot be written: refused before anything is written, naming the argument."""
    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "file").write_bytes(b"x")
    for local, message in (
        (durable, "is the same folder as path"),
        (durable / "fast", "is inside path"),
        (tmp_path, "contains path"),
        (tmp_path / "file", "local_path '.*file' is not a folder"),
    ):
        with pytest.raises(ValueError, match=message):
            save_checkpoint(durable, "t", model=_linear(0), local_path=local, replicas=1)
        with pytest.raises(ValueError, match=message):
            resume_from_checkpoint(durable, model=_linear(0), local_path=local)
    assert sorted(os.listdir(durable)) == [] and sorted(os.listdir(tmp_path)) == ["durable", "file"]
    if os.access("/sys", os.W_OK) and not os.path.isdir("/sys/kernel"):
        pytest.skip("no folder that cannot be written here")
    with pytest.raises(ValueError, match="local_path '/sys' is not writable"):
        save_checkpoint(durable, "t", model=_linear(0), local_path="/sys", replicas=1)


def test_a_tag_in_either_tier_is_not_saved_again(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=fast, replicas=1)
    wait_for_saves()
    with pytest.raises(Exception, match="already committed in the fast tier"):
        save_checkpoint(durable, "s1", model=_linear(2), local_path=fast, replicas=1)
    os.rename(_job(fast, durable) / "s1_partial", tmp_path / "moved")
    with pytest.raises(Exception, match="already holds a committed checkpoint"):
        save_checkpoint(durable, "s1", model=_linear(2), local_path=fast, replicas=1)


def test_a_folder_the_job_does_not_own_is_neither_loaded_nor_saved_over(tmp_path: Path) -> None:
    """A copy of s1 placed in the job's folder as s2 (its manifest names tag s1): foreign. A resume
    skips it with a warning; a save of s2 is refused, leaving it as it was."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    job = _job(fast, durable)
    m1 = _linear(1)
    save_checkpoint(durable, "s1", model=m1, local_path=fast, replicas=1, durable_every=5)
    shutil.copytree(job / "s1_partial", job / "s2_partial")
    got = _linear(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_from_checkpoint(durable, model=got, local_path=fast)
    assert any("folder s2_partial is foreign (checkpoint 's1' of" in str(w.message) for w in caught)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "fast") and _same(got, m1)
    before = sorted(os.listdir(job / "s2_partial"))
    with pytest.raises(CheckpointExists, match="s2_partial is foreign"):
        save_checkpoint(durable, "s2", model=_linear(2), local_path=fast, replicas=1, durable_every=5)
    assert sorted(os.listdir(job / "s2_partial")) == before


def test_drain_to_s3_and_resume_from_it(s3_root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """S3 (moto on loopback) as the durable root: the fast tier writes the files under hex prefixes,
    the drain copies them under the same names, and a resume without the fast tier reads them."""
    import s3fs

    root, options = s3_root
    local = tmp_path / "fast"
    m1 = _linear(1)
    save_checkpoint(root, "s1", model=m1, local_path=local, replicas=1, storage_options=options)
    wait_for_saves()
    fs = s3fs.S3FileSystem(**options)
    bucket_path = root[len("s3://") :]
    names = sorted(p[len(bucket_path) + 1 :] for p in fs.find(f"{bucket_path}/s1_partial"))
    job = Path(job_folder(str(local), durable_key(root, options)))
    local_names = sorted(str(p.relative_to(job / "s1_partial")) for p in (job / "s1_partial").rglob("*") if p.is_file())
    assert [n.split("/", 1)[1] for n in names] == local_names
    assert any(n.count("/") == 2 for n in names)  # s1_partial/<prefix>/<file>
    got = _linear(9)
    resume_from_checkpoint(root, model=got, storage_options=options, local_path=tmp_path / "empty")
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "durable")
    assert _same(got, m1)


def test_tag_asked_for_comes_from_the_fast_tier_when_its_drain_never_committed(tmp_path: Path) -> None:
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1)
    save_checkpoint(durable, "s2", model=m2, local_path=local, replicas=1)
    wait_for_saves()
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # as a drain killed before its commit
    for tag, want in (("s1", m1), ("s2", m2)):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == (tag, "fast")
        assert _same(got, want)
    with pytest.raises(Exception, match="no checkpoint 's3'"):
        resume_from_checkpoint(durable, tag="s3", model=_linear(9), local_path=local)


def test_tag_asked_for_incomplete_in_the_fast_tier_is_refused_saying_so(tmp_path: Path) -> None:
    """The refusal named only path ("no checkpoint 's1' under ..."), as if the tag had never been saved,
    while the fast tier holds it committed but missing a part (a lost node's): now it says so, by file."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=5)
    folder = _job(local, durable) / "s1_partial"
    lost = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    (folder / lost).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=f"no checkpoint 's1' under .*committed but incomplete .*{lost}"):
            resume_from_checkpoint(durable, tag="s1", model=_linear(9), local_path=local)


def test_a_state_that_does_not_fit_the_newest_save_is_refused_not_resumed_from_an_older_one(tmp_path: Path) -> None:
    """s2 saved after the model went bf16; the restarted code builds it fp32. Without the fast tier the
    resume refuses (the dtype, by key); with it, the "this copy failed, try the next" fallback meant for
    damaged copies loaded the older s1, with only a warning. Now refused alike."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1 = _linear(1)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1, durable_every=5)
    save_checkpoint(durable, "s2", model=_linear(2).to(torch.bfloat16), local_path=local, replicas=1, durable_every=5)
    got = _linear(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LayoutMismatch, match="saved as torch.bfloat16 but the destination is torch.float32"):
            resume_from_checkpoint(durable, model=got, local_path=local)
    assert not _same(got, m1)


def test_a_drain_that_fails_leaves_no_empty_folder_in_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain failing mid-copy (the durable storage's disk full) removed the files it had copied but left
    an empty ``<tag>_partial/`` in ``path``: debris no tool cleaned and ``ls`` showed. Removed when empty
    now; the fast tier still holds the tag, and the next save drains."""
    import smpckpt.api._drain as drain_module

    durable, local = tmp_path / "durable", tmp_path / "fast"
    real, calls = drain_module.open_sink, []

    def disk_full_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(28, "injected: no space left on the durable storage")
        return real(*args, **kwargs)

    monkeypatch.setattr(drain_module, "open_sink", disk_full_once)
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


def test_tag_asked_for_comes_from_the_durable_tier_when_saved_there_again_after_the_fast_copy(tmp_path: Path) -> None:
    """A tag saved through the fast tier, then saved again in ``path`` (``overwrite=True``, by a job
    without the fast tier): the fast tier still holds the older save of that tag. A resume of that tag
    takes the newer durable one, as a resume of the newest does (it once took the fast copy, silently)."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "final", model=m1, local_path=local, replicas=1)
    wait_for_saves()
    save_checkpoint(durable, "final", model=m2, overwrite=True)
    for tag in (None, "final"):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("final", "durable"), (tag, info)
        assert _same(got, m2), tag


def _abandoned_fast_history(tmp_path: Path) -> tuple[Path, FastTier, dict[str, nn.Module]]:
    """Job A (fast tier, durable_every=3) saves s1..s5: only s3 reaches path. Job B, without the fast
    tier, resumes s3 from path and saves b1 -- numbered after path's s3 only, so below A's s5."""
    durable = tmp_path / "durable"
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=3)
    models = {f"s{s}": _linear(s) for s in range(1, 6)} | {"b1": _linear(100)}
    with Checkpointer(durable, fast_tier=fast) as a:
        for s in range(1, 6):
            a.save(f"s{s}", models[f"s{s}"])
    with Checkpointer(durable) as b:
        got = _linear(99)
        b.resume(model=got)
        assert b.last_resume_info is not None and b.last_resume_info.tag == "s3"
        assert _same(got, models["s3"])
        b.save("b1", models["b1"])
    return durable, fast, models


def test_a_fast_tier_history_a_job_without_it_abandoned_is_refused_by_name(tmp_path: Path) -> None:
    """tag=None with the fast tier again: its s5 (sequence 5) outranks b1 (4), but b1 continued the run
    and s5's job never saw it. Neither number nor clock says which history the user continues: refused,
    naming both (it once resumed the abandoned s5, silently); tag= picks either, bit-exact."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    with Checkpointer(durable, fast_tier=fast) as c:
        with pytest.raises(
            CheckpointError,
            match=r"ambiguous resume.*'s5' \(sequence number 5\).*'b1', sequence "
            r"number 4.*resume\(tag='b1'\).*resume\(tag='s5'\)",
        ):
            c.resume(model=_linear(99))
        for tag, tier in (("b1", "durable"), ("s5", "fast")):
            got = _linear(99)
            c.resume(tag=tag, model=got)
            info = c.last_resume_info
            assert info is not None and (info.tag, info.tier) == (tag, tier)
            assert _same(got, models[tag])


def test_a_fast_tier_history_continued_from_the_durable_one_resumes_as_before(tmp_path: Path) -> None:
    """After tag='b1' chose path's history, the fast tier's next save c1 knew b1: tag=None takes it again,
    and when c1 cannot be loaded the abandoned s5 is no fallback: path's b1 is (it once was s5, silently).
    A job that enables a fast tier on a root of plain saves (resuming one, or starting afresh) resumes
    its fast-tier saves as before."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    fast = FastTier(local_path=fast.local_path, replicas=1, durable_every=10)  # c1 stays in the fast tier
    with Checkpointer(durable, fast_tier=fast) as c:
        c.resume(tag="b1", model=_linear(99))
        models["c1"] = _linear(101)
        c.save("c1", models["c1"])
    local = _job(Path(fast.local_path), durable)
    assert _partials(local) == ["c1_partial", "s5_partial"]  # num_kept_local=2: the abandoned s5 stays
    for broken in (False, True):
        if broken:  # one node: no intact copy anywhere, the fast copy of c1 fails
            data = next(p for p in (local / "c1_partial").iterdir() if p.name.endswith(".distcp"))
            data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))
        with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _linear(99)
            c.resume(model=got)
            info = c.last_resume_info
        want = "b1" if broken else "c1"
        assert info is not None and (info.tag, info.tier) == (want, "durable" if broken else "fast")
        assert _same(got, models[want])

    plain = tmp_path / "plain"
    with Checkpointer(plain) as p:
        p.save("p1", _linear(1))
    for resumed in (True, False):
        tier = FastTier(local_path=str(tmp_path / f"fast-{resumed}"), replicas=1, durable_every=3)
        with Checkpointer(plain, fast_tier=tier) as f:
            if resumed:
                f.resume(model=_linear(99))
            f.save(f"f-{resumed}", _linear(2))
        with Checkpointer(plain, fast_tier=tier) as f:
            got = _linear(99)
            f.resume(model=got)
            info = f.last_resume_info
            assert info is not None and (info.tag, info.tier) == (f"f-{resumed}", "fast")
            assert _same(got, _linear(2))


def test_a_plain_writer_of_the_root_beside_a_tiered_one_in_one_process_is_no_divergence(tmp_path: Path) -> None:
    """Two Checkpointers of one root in one process, one with the fast tier: p2 (plain) is saved between
    the fast-only s1 and s3. s3's draw read p2's number from ``newest``, so s3 knew it: tag=None resumes
    s3 as before, not refused."""
    durable, fast = tmp_path / "durable", FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=5)
    models = {tag: _linear(i) for i, tag in enumerate(("s1", "p2", "s3"), 1)}
    with Checkpointer(durable, fast_tier=fast) as a, Checkpointer(durable) as b:
        a.save("s1", models["s1"])
        b.save("p2", models["p2"])
        a.save("s3", models["s3"])
    assert _tier_record(_job(Path(fast.local_path), durable) / "s3_partial")["path_seen"] == 1  # p2's number
    with Checkpointer(durable, fast_tier=fast) as c:
        got = _linear(99)
        c.resume(model=got)
        info = c.last_resume_info
    assert info is not None and (info.tag, info.tier) == ("s3", "fast")
    assert _same(got, models["s3"])


# -- 2 nodes x 2 ranks -------------------------------------------------------------------------------
# Spawning 4 ranks costs ~9 s on 2 cores: one world runs every case without a killed rank, one world
# per kill, one world resumes both killed jobs, one 2-rank world reshards.
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("tiers")
    return base, run_world(tier_workers.main_world, 4, str(base))


def _reports(base: Path) -> dict[int, Any]:
    out = {}
    for rank in range(4):
        path = base / f"report{rank}.pkl"
        if path.exists():
            out[rank] = pickle.loads(path.read_bytes())
    return out


@pytest.fixture(scope="module")
def killed(
    tmp_path_factory: pytest.TempPathFactory, world: tuple[Path, list[dict[str, Any]]]
) -> tuple[Path, dict[str, dict[int, Any]], list[dict[str, Any]]]:
    """Rank 3 killed during step2's replica transfers; rank 1 killed during step2's drain; rank 2 killed
    between the node commits; rank 1 killed during step3's drain (num_kept_local=2); then one restarted
    world resumes these and the five saves of ``world``."""
    base = tmp_path_factory.mktemp("killed")
    reports = {}
    for name, fn, victim in (
        ("replication", tier_workers.killed_in_replication, 3),
        ("drain", tier_workers.killed_in_drain, 1),
        ("commit", tier_workers.killed_between_node_commits, 2),
        ("drain3", tier_jobs_workers.killed_in_drain_of_step3, 1),
    ):
        (base / name / "fast").mkdir(parents=True)
        with pytest.raises(RankFailed, match=f"rank {victim}: no result"):
            run_world(fn, 4, str(base / name / "fast"), str(base / name / "durable"), timeout=180)
        reports[name] = _reports(base / name / "fast")
    return base, reports, run_world(tier_workers.restarted, 4, str(base), str(world[0]))


@pytest.mark.dist
def test_five_saves_keep_two_fast_and_drain_the_third(world: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(world[1]):
        for mode in ("sync", "async"):
            assert r[mode]["local_after_saves"] == ["step4_partial", "step5_partial"], (rank, mode)
            assert r[mode]["durable_after_saves"] == ["newest", "step3_partial"], (rank, mode)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_node_lost_resumes_the_fifth_save_from_peer_replicas(killed: Any, mode: str) -> None:
    restarted = killed[2]
    for rank, r in enumerate(restarted):
        got = r[mode]["one_node_lost"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step5", "fast", {"step": 5}, True), rank
        peers = got["from_peers"]
        assert peers and {dst for _, _, dst in peers} == {2}  # node 1's first rank fetched, once per file
        assert {src for _, src, _ in peers} <= {0, 1}
    assert restarted[2][mode]["local_after_heal"] == ["step5_partial"]  # the lost node holds the copy again


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_fast_tier_lost_resumes_the_newest_durable_save(killed: Any, mode: str) -> None:
    for rank, r in enumerate(killed[2]):
        got = r[mode]["all_lost"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step3", "durable", {"step": 3}, True), rank


@pytest.mark.dist
def test_ranks_without_local_world_size_or_with_different_node_folders_are_refused(
    world: tuple[Path, list[dict[str, Any]]],
) -> None:
    for rank, r in enumerate(world[1]):
        got = r["refusals"]
        assert "needs LOCAL_WORLD_SIZE" in got["no_lws"], (rank, got)
        assert "local_path differs between ranks of node" in got["mates_differ"], (rank, got)
        assert got["left"] == [], (rank, got)


@pytest.mark.dist
def test_a_smaller_world_reshards_from_the_fast_tier(world: tuple[Path, list[dict[str, Any]]]) -> None:
    base, saved = world[0] / "reshard", [r["reshard"] for r in world[1]]
    out = run_world(tier_workers.resume_resharded, 2, str(base / "fast"), str(base / "durable"))
    for rank, r in enumerate(out):
        assert (r["tag"], r["tier"], r["uc"], r["layout_changed"]) == ("step2", "fast", {"step": 2}, True), rank
        want = saved[rank]  # old ranks 0 and 1 are tp 0 and 1 of dp 0: the same pieces
        assert r["state"].keys() == want.keys()
        assert all(torch.equal(r["state"][k], want[k]) for k in want), rank


@pytest.mark.dist
def test_kill_during_replication_leaves_the_previous_save_newest(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["replication"]
    assert sorted(rep) == [0, 1, 2], rep  # rank 3 died; every other rank got an error, none hung
    for rank, got in rep.items():
        assert got["error"].startswith("CheckpointError"), (rank, got)
        if rank % 2 == 0:  # each node's first rank removed its copy of the uncommitted step2
            assert got["local"] == ["step1_partial"], (rank, got)
    for rank, r in enumerate(resumed):
        got = r["replication"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step1", "fast", True), rank
        again = got["after_resave"]  # the tag saves again: its leftovers were settled
        assert (again["tag"], again["tier"], again["uc"], again["exact"]) == ("step2", "fast", {"step": 2}, True)


@pytest.mark.dist
def test_kill_during_the_drain_keeps_both_tiers_usable(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["drain"]
    assert 1 not in rep and rep, rep
    for rank, got in rep.items():
        assert "drain of checkpoint 'step2'" in got["error"], (rank, got)
    durable = base / "drain" / "durable"
    assert (durable / "newest").read_text().strip() == "step1"
    for rank, r in enumerate(resumed):
        # the fast tier committed step2 before its drain began: it is the newest checkpoint ...
        got = r["drain"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step2", "fast", True), rank
        # ... and the last durable checkpoint was never lost
        got = r["drain_no_fast"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step1", "durable", True), rank


@pytest.mark.dist
def test_kill_between_the_node_commits_leaves_a_complete_checkpoint(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["commit"]
    assert 2 not in rep and rep, rep
    node1 = _job(base / "commit" / "fast" / "node1", base / "commit" / "durable") / "step2_partial"
    assert "smpckpt.manifest.json" not in rep[3]["step2"], rep[3]  # node 1 never committed its copy
    for rank, r in enumerate(resumed):
        # every node held its share before any committed: the union of the copies is complete
        got = r["commit"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step2", "fast", True), rank
    assert (node1 / "smpckpt.manifest.json").exists()  # the resume sent node 1 the manifest


@pytest.mark.dist
def test_a_drain_killed_is_retried_by_the_next_save_and_never_lost(killed: Any) -> None:
    """durable_every=3, num_kept_local=2: rank 1 killed while draining step3. The restarted job resumes
    step3 from the fast tier; its next save drains step3 again (a warning says so) and retention keeps
    step3 until then; with every fast tier lost, step3 comes from the durable tier."""
    base, reports, resumed = killed
    rep = reports["drain3"]
    assert 1 not in rep and rep, rep
    for rank, got in rep.items():
        assert "drain of checkpoint 'step3'" in got["error"], (rank, got)
        if rank % 2 == 0:
            assert got["local"] == ["step2_partial", "step3_partial"], (rank, got)
        # the kill left path without step3, and rank 1's file begun there (others' may be being removed)
        assert MANIFEST_NAME not in got["durable_step3"], (rank, got)
        assert any("_r1_" in name for name in got["durable_step3"]), (rank, got)
    for rank, r in enumerate(resumed):
        got = r["retry"]
        assert (got["resume"]["tag"], got["resume"]["tier"], got["resume"]["exact"]) == ("step3", "fast", True), rank
        if rank == 0:
            said = got["warnings"]
            assert len([w for w in said if "'step3' (save 3) was due for the durable tier" in w]) == 1, said
            assert "draining it to" in said[0] and "again" in said[0], said
        if rank % 2 == 0:
            assert got["fast"] == ["step4_partial", "step5_partial"], (rank, got)
        assert got["durable"] == ["newest", "step3_partial"], (rank, got)
        no_fast = got["no_fast"]
        assert (no_fast["tag"], no_fast["tier"], no_fast["uc"], no_fast["exact"]) == (
            "step3",
            "durable",
            {"step": 3},
            True,
        )


# -- issue 46: jobs apart, crafted and corrupt folders, folders refused (one 4-rank world) ----------------
@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("cases")
    return base, run_world(tier_jobs_workers.new_cases, 4, str(base), timeout=300)


def _cli(*argv: str) -> tuple[int, str, str]:
    from smpckpt.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.dist
def test_jobs_sharing_local_path_see_only_their_own_copies(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    """X saves step1-2 in the fast tier only; Z (a new run, empty path) resumes with missing_ok and saves
    step1; Y saves three with num_kept_local=2; a link to Y's step103 sits in X's folder as step9."""
    base, results = cases
    for rank, r in enumerate(results):
        got = r["jobs"]
        assert got["z_resume"] == "ok None", (rank, got)  # starts fresh: X's step2 is not Z's
        assert got["z_save"] == "ok None", (rank, got)  # X's step1 is no obstacle to Z's
        assert got["jobs"] == {
            "X": ["step1_partial", "step2_partial", "step9_partial"],  # Y's retention left X's alone
            "Y": ["step102_partial", "step103_partial"],
            "Z": ["step1_partial"],
        }, (rank, got)
        x = got["x_resume"]
        assert (x["tag"], x["tier"], x["uc"], x["exact"]) == ("step2", "fast", {"step": 2}, True), (rank, x)
        assert any("folder step9_partial is foreign" in w and "a link to" in w for w in x["warnings"]), x
    jobs = base / "jobs"
    nodes = [str(jobs / "fast" / f"node{n}") for n in (0, 1)]
    rc, out, err = _cli("ls", str(jobs / "X"), "--local", *nodes)
    assert rc == 0, err
    tags = [line.split()[1 if line.startswith(">") else 0] for line in out.splitlines() if "step" in line[:12]]
    assert tags[:3] == ["step2", "step1", "step9"], out
    assert "note: step9 is foreign: " in out
    for name in ("Y", "Z"):
        root = durable_key(str(jobs / name), None)
        for node in nodes:
            assert f"other job: {job_folder(node, root)} (durable root {root}): " in out, out
    assert out.splitlines()[-1] == "resume: step2 from the fast tier", out


@pytest.mark.dist
def test_a_crafted_newer_incomplete_save_keeps_no_retention_slot(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(cases[1]):
        if rank == 0:
            assert r["slot"]["after"] == ["step2_partial", "step3_partial", "zz_partial"], r["slot"]
        elif rank == 2:
            assert r["slot"]["after"] == ["step2_partial", "step3_partial"], r["slot"]


@pytest.mark.dist
def test_unsafe_fast_tier_folders_are_skipped_alike_on_every_rank(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    base, results = cases
    said = [r["unsafe"]["warnings"] for r in results]
    for rank, r in enumerate(results):
        got = r["unsafe"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step2", "fast", {"step": 2}, True), rank
        assert got["save3"] == "ok None", (rank, got)
        assert said[rank] == said[0], rank  # one judgement, shared
        junk = ["junk_abs_partial", "junk_climb_partial", "junk_meta_partial"] if rank < 2 else ["junk_node1_partial"]
        assert got["after"] == [*junk, "step2_partial", "step3_partial"], got  # retention left them alone
    assert [w.split("folder ")[1].split(" ")[0] for w in said[0]] == [
        "junk_abs_partial",
        "junk_climb_partial",
        "junk_meta_partial",
        "junk_node1_partial",
    ], said[0]
    unsafe = base / "unsafe"
    rc, out, err = _cli("ls", str(unsafe / "durable"), "--local", *(str(unsafe / "fast" / f"node{n}") for n in (0, 1)))
    assert rc == 0, err
    for tag in ("junk_abs", "junk_climb", "junk_meta", "junk_node1"):
        assert f"note: {tag} is unsafe: " in out, out


@pytest.mark.dist
def test_a_corrupt_fast_tier_file_heals_from_a_peer_then_the_next_save(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, results = cases
    victim = results[0]["heal"]["victim"]
    for rank, r in enumerate(results):
        got = r["heal"]["one_copy"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step3", "fast", {"step": 3}, True), rank
        assert [(src // 2, dst) for name, src, dst in got["from_peers"] if name == victim] == [(1, 0)], got
        if rank == 0:  # rank 0 warns
            assert any("'step3' has corrupt parts" in w and "fetching them from peers" in w for w in got["warnings"])
        assert r["heal"]["healed"], rank  # node 0's copy is intact again
        got = r["heal"]["both_copies"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step2", "fast", {"step": 2}, True), rank
    assert any("'step3' from the fast tier failed" in w for w in results[0]["heal"]["both_copies"]["warnings"])
    heal = base / "heal"
    nodes = [str(heal / "fast" / f"node{n}") for n in (0, 1)]
    rc, out, err = _cli("verify", f"{heal / 'durable'}/step2", "--local", *nodes)
    assert rc == 1, out + err
    removed = results[0]["heal"]["removed"]
    assert f"step2: {removed} (rank 0's data file) is held intact by 1 of the 2 folders" in err, err
    rc, out, err = _cli("verify", f"{heal / 'durable'}/step1", "--local", *nodes)
    assert rc == 0, out + err


@pytest.mark.dist
def test_a_drain_copies_a_damaged_file_from_a_peers_intact_replica_and_fails_only_when_none_is(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """rev58b F6: the drain copied each file from the rank that wrote it; a damaged copy there failed the
    drain, and every retry failed alike (a peer's intact replica was never tried) until a resume healed
    it. Now a copy that fails the check is taken from the next node holding the file; only when no node
    holds it intact does the drain fail, naming the file, the tag and every node tried; nothing of it in
    ``path``; the fast tier keeps the save."""
    for rank, r in enumerate(cases[1]):
        got = r["replica"]
        assert got["save1"] == "ok None", (rank, got)
        assert "injected: no space left on path's storage" in got["save2"], (rank, got)
        assert got["save3"] == "ok None", (rank, got)  # step2 drained, its damaged file from node 1
        assert got["victim_units"] > 1, got  # node 0's copy failed after its first blocks were copied
        assert got["from_path"] == "ok {'uc': {'step': 2}, 'exact': True}", (rank, got)
        assert "injected: no space left on path's storage" in got["save4"], (rank, got)
        said, victim = got["save5"], got["victim4"]
        assert f"the drain of 'step4' copies nothing damaged: no fast tier holds an intact copy of {victim}" in said
        assert "held by node(s) 0, 1; tried node 0 (ranks 0..1): " in said and "; node 1 (ranks 2..3): " in said, said
        assert said.count("checksum mismatch") == 2, said
        assert got["durable"] == ["newest", "step2_partial"], (rank, got)  # nothing of step4
        assert got["newest"] == "ok b'step2'", (rank, got)
        assert got["fast"] == [["step4_partial", "step5_partial"]] * 2, (rank, got)  # step4 kept, on both nodes
        assert got["step4_kept"] == [True, True], (rank, got)
    first = cases[1][0]["replica"]
    assert first["partial"]["aborted"] == 1 and first["partial"]["written"] > 0, first  # node 0's copy: begun, aborted
    assert (first["victim_intact"], first["verify"]) == ("ok True", "ok ()"), first
    assert any("the drain of 'step2' copied 1 file(s) from a peer's intact replica" in w for w in first["warnings"])


@pytest.mark.dist
def test_a_node_back_with_an_older_save_of_the_tag_still_loads_the_newer(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Node 1's stale disk held the older step1's manifest: healing the newer one's in was refused
    (``File exists``), so the newer step1, complete on node 0, never loaded (the resume fell back or failed).
    A damaged manifest on node 1 ("damaged") refused it alike, and so did parts cut short there ("cut_short":
    counted as missing, fetched under the same name) -- README promised a file cut short heals."""
    for rank, r in enumerate(cases[1]):
        for tag in ("None", "step1", "damaged", "cut_short"):
            got = r["stale"][tag]
            assert isinstance(got, dict), (rank, tag, got)
            assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step1", "fast", {"step": 12}, True), rank


@pytest.mark.dist
def test_fast_tier_folders_refused_up_front_by_name(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in cases[1]:
        got = r["refused"]
        for how in ("", "_resume"):
            assert got[f"shared{how}"].startswith("ValueError") and "passes too" in got[f"shared{how}"], got
            assert "is the same folder as path" in got[f"same{how}"], got
            assert "is inside path" in got[f"inside{how}"], got
            assert "contains path" in got[f"contains{how}"], got
            assert "local_path" in got[f"file{how}"] and "is not a folder" in got[f"file{how}"], got
            if os.path.isdir("/sys/kernel"):
                assert "local_path '/sys' is not writable" in got[f"read_only{how}"], got
        assert got["left"] == (["durable", "file", "shared"], []), got
        assert got["shared_left"] == [], got


@pytest.mark.dist
def test_a_node_back_with_an_abandoned_history_is_refused_not_resumed(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    """Every fast tier lost after step9 (step5 drained, step8 and step9 kept): the job resumed step5 and
    saved new6. Node 1 came back with its old disk holding step8 and step9 whole: tag=None resumed step9,
    the abandoned history, on every rank without a word. Each save records the digests of the saves it
    was numbered after (its lineage, 16 back: step9 names step6, beyond what retention kept), so a save of
    one of those numbers that is not the one named is another history: refused, naming both; by tag, each
    loads bit-exact; a save made after going on from new6 (in sight of both) resumes."""
    _, results = cases
    for r in range(4):
        fork = results[r]["fork"]
        assert fork["after_loss"].startswith("ok"), fork
        assert fork["none"].startswith("CheckpointError: ambiguous resume"), fork["none"]
        assert "'step9' (save 9) and 'new6' (save 6)" in fork["none"]
        assert fork["new6"]["tag"] == "new6" and fork["new6"]["exact"], fork["new6"]
        assert fork["step9"]["tag"] == "step9" and fork["step9"]["exact"], fork["step9"]
        assert fork["went_on"]["tag"] == "new7" and fork["went_on"]["exact"], fork["went_on"]


def test_lineage_skips_what_the_job_saw_and_left_and_ends_at_path() -> None:
    """(pure logic, rev58c) A rewind by tag wrote "fork-seen", which switched the fork check off for 16
    saves: a later real fork resumed the abandoned history silently. A save after a resume from ``path``
    had an empty lineage, and the heal then refused same-history stale copies, falling back to an older
    save. Now the numbers a job saw and did not go on from are skipped, the rest stays checked, and a
    lineage ends where ``path``'s checkpoint was gone on from."""
    from smpckpt.api._fast_resume import lineage_for, refuse_forked
    from smpckpt.api._tiers import PATH_MARK, SKIPPED, LocalCopy, candidates

    def copy(seq: int, lineage: tuple[int, ...] = (), history: int = 1000) -> LocalCopy:
        return LocalCopy("committed", {}, history + seq, seq, (seq, seq, ""), {}, lineage=lineage)

    saves: dict[str, LocalCopy] = {}
    for seq in range(1, 8):  # s1..s7, each numbered after the one before
        saves[f"s{seq}"] = copy(seq, lineage_for([saves], 0, None))
    assert saves["s7"].lineage == tuple(range(1006, 1000, -1))
    s8 = copy(8, lineage_for([saves], 0, saves["s6"].digest))  # the job rewound to s6 by tag
    assert s8.lineage == (SKIPPED, 1006, 1005, 1004, 1003, 1002, 1001)
    s9 = copy(9, lineage_for([{**saves, "s8": s8}], 0, s8.digest))
    views = [{"s8": s8, "s9": s9}]
    refuse_forked(candidates(views)[0], candidates(views))  # nothing else at its numbers: no fork
    forked = [
        {**views[0], "new6": copy(6, history=2000)}
    ]  # another history's save 6 (the fast tiers lost, path's s5 resumed)
    with pytest.raises(CheckpointError, match=r"two histories of this job: 's9' \(save 9\) and 'new6' \(save 6\)"):
        refuse_forked(candidates(forked)[0], candidates(forked))
    # after a resume from path's save 4 the next save's lineage ends there; stale saves 3, 4 of the same
    # history back on a node are no fork
    x5 = copy(5, lineage_for([{}], 4, PATH_MARK))
    c6 = copy(6, lineage_for([{"x5": x5}], 4, x5.digest))
    assert (x5.lineage, c6.lineage) == ((), (1005,))
    back = [{"x5": x5, "c6": c6, "c3": copy(3), "a4": copy(4)}]
    refuse_forked(candidates(back)[0], candidates(back))


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
