"""Retention after each save reads only what changed: the Checkpointer keeps the root's committed records
(catalog.root.ManifestCache) and serves one again only while its manifest is the same file on disk. Counted
on a real local filesystem (every manifest read goes through LocalFileSystem.cat_file); an overwrite of a
cached tag by another writer is seen, so retention removes exactly the right tags, and every kept one
resumes bit-exactly."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import Checkpointer, FastTier, Retention, SaveOptions, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog.root import scan_root
from smpckpt.storage import MANIFEST_NAME
from smpckpt.storage.backends import _fs
from smpckpt.storage.format.manifest import _self_digest

SETTLE = 1.05  # a manifest is served from the cache once its file is a second old (a clock tick's reuse)


class Settle:
    """Time passing for the cache's settle check alone, instead of ``time.sleep(SETTLE)`` (~26 s of the
    suite's wall time): each :meth:`wait` ages every file that exists then by ``SETTLE``, exactly as a
    sleep would, and none written after it (the real :func:`_fs.file_stamp` is asked with its threshold
    lowered by the waits since the file's ctime; every other clock is real)."""

    def __init__(self, monkeypatch: Any) -> None:
        self._waits: list[int] = []  # time.time_ns() at each wait
        real = _fs.file_stamp

        def aged(fs: Any, path: str, settled_ns: int = 10**9) -> tuple[int, ...]:
            try:
                ctime = os.stat(path, follow_symlinks=False).st_ctime_ns
            except OSError:
                return real(fs, path, settled_ns)
            credit = sum(int(SETTLE * 10**9) for at in self._waits if ctime < at)
            return real(fs, path, settled_ns - credit)

        monkeypatch.setattr(_fs, "file_stamp", aged)

    def wait(self, really: bool = True) -> None:
        """A sleep of ``SETTLE`` for the check: files stamped before now are ``SETTLE`` older."""
        if really:
            self._waits.append(time.time_ns())
            # files are stamped from a clock up to a tick (<= 10 ms) behind: one written after this wait
            # must be stamped after it
            time.sleep(0.02)


@pytest.fixture
def settle(monkeypatch: Any) -> Settle:
    return Settle(monkeypatch)


def _manifest_reads(monkeypatch: Any) -> list[str]:
    from fsspec.implementations.local import LocalFileSystem

    reads: list[str] = []
    real = LocalFileSystem.cat_file

    def counted(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(MANIFEST_NAME):
            reads.append(str(path))
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "cat_file", counted)
    return reads


def _filled(value: float) -> nn.Module:
    m = nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.fill_(value)
        m.bias.fill_(-value)
    return m


def _assert_resumes(root: str, tag: str, value: float) -> None:
    got = nn.Linear(3, 2)
    resume_from_checkpoint(root, tag=tag, model=got)
    want = _filled(value)
    assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias), tag


def _tags(root: str) -> list[str]:
    return sorted(r.tag for r in scan_root(root) if r.committed)


def test_reads_per_save_do_not_grow_with_the_checkpoints_kept(tmp_path: Any, monkeypatch: Any, settle: Settle) -> None:
    root, keep = str(tmp_path), 5
    reads = _manifest_reads(monkeypatch)
    m = _filled(0)
    per_save = []
    for i in range(keep + 2):
        with torch.no_grad():
            m.weight.fill_(i)
            m.bias.fill_(-i)
        settle.wait(i > 0)
        reads.clear()
        save_checkpoint(root, f"s{i}", model=m, num_kept_partial_checkpoints=keep)
        per_save.append(len(reads))
    # newest's record (the sequence number), the tag's own probe, the new checkpoint, and the one removed
    # (a victim's manifest is read again before it goes): not one per kept one
    assert per_save[-2:] == [4, 4], per_save
    assert _tags(root) == [f"s{i}" for i in range(2, keep + 2)]
    for i in range(2, keep + 2):
        _assert_resumes(root, f"s{i}", i)


def test_a_cached_tag_overwritten_by_another_writer_is_read_again_and_kept(tmp_path: Any, settle: Settle) -> None:
    """The Checkpointer read s0 (sequence 1) and kept its record; another writer (its own Checkpointer)
    overwrites s0, now numbered after s2. The next save's retention (keep 3) must see s0's new number and
    remove s1: a stale record (s0 still 1) would remove s0, the newest but one, overwritten data and all."""
    root, m = str(tmp_path), _filled(0)
    for i in range(3):
        with torch.no_grad():
            m.weight.fill_(i)
            m.bias.fill_(-i)
        settle.wait(i == 2)  # s0 and s1 are a second old when s2's retention reads them
        save_checkpoint(root, f"s{i}", model=m, num_kept_partial_checkpoints=3)
    assert _tags(root) == ["s0", "s1", "s2"]
    save_checkpoint(root, "s0", model=_filled(7), options=SaveOptions(overwrite=True))  # another model: writer
    settle.wait()  # the new manifest is settled too: only its identity tells it from the cached one
    with torch.no_grad():
        m.weight.fill_(3)
        m.bias.fill_(-3)
    save_checkpoint(root, "s3", model=m, num_kept_partial_checkpoints=3)
    assert _tags(root) == ["s0", "s2", "s3"]
    _assert_resumes(root, "s0", 7)
    _assert_resumes(root, "s2", 2)
    _assert_resumes(root, "s3", 3)


def test_a_link_planted_in_a_cached_checkpoint_is_still_refused(tmp_path: Any, settle: Settle) -> None:
    """A cached record is served only while its files are confined: a data file replaced by a link leading
    out of the folder makes the folder unsafe, never removed, exactly as without the cache."""
    root, m = str(tmp_path), _filled(0)
    for i in range(3):
        settle.wait(i == 2)
        save_checkpoint(root, f"s{i}", model=m, num_kept_partial_checkpoints=3)
    folder = tmp_path / "s0_partial"
    data = next(p for p in folder.rglob("*.distcp"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    save_checkpoint(root, "s3", model=m, num_kept_partial_checkpoints=1)
    states = {r.tag: r.state for r in scan_root(root)}
    assert states == {"s0": "unsafe", "s3": "committed"}, states
    assert outside.exists() and data.is_symlink()


@pytest.mark.parametrize("stamp", ["real", "lying"])
def test_a_cached_manifest_rewritten_in_place_never_condemns_its_checkpoint(
    tmp_path: Any, monkeypatch: Any, settle: Settle, stamp: str
) -> None:
    """rev61a F1: s0's manifest rewritten in place (same inode, same size, mtime put back, as ``cp -p`` onto
    the file does), its sequence 1 -> 9: only the ctime tells. "lying": every stamp the same (an NFS
    client's attribute cache serving an old stat): retention still reads a victim's manifest again before it
    removes it. Either way s0, now numbered after s3, stays (another job's save: nothing removed)."""
    if stamp == "lying":
        monkeypatch.setattr(_fs, "file_stamp", lambda fs, path, settled_ns=10**9: (1,))
    root, m = str(tmp_path), _filled(0)
    for i in range(3):
        settle.wait(i == 2)
        save_checkpoint(root, f"s{i}", model=m, num_kept_partial_checkpoints=3)
    path = os.path.join(root, "s0_partial", MANIFEST_NAME)
    st, data = os.stat(path), open(path, "rb").read()
    record = json.loads(data)
    old = record.pop("manifest_xxh3_64")
    record["extra"]["sequence"] = 9
    new = data.replace(b'"sequence": 1,', b'"sequence": 9,').replace(
        old.encode(), f"{_self_digest(record):016x}".encode()
    )
    assert len(new) == len(data) and new != data
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    settle.wait()
    save_checkpoint(root, "s3", model=m, num_kept_partial_checkpoints=3)
    assert _tags(root) == ["s0", "s1", "s2", "s3"]


def test_the_drains_retention_reuses_the_kept_records_too(tmp_path: Any, monkeypatch: Any, settle: Settle) -> None:
    """rev61a F2: with the fast tier, retention runs in the drain, which read every kept manifest of the
    durable root again (3, 5, 6, ... 9 reads per save at keep 5)."""
    root, node, keep = str(tmp_path / "root"), str(tmp_path / "node"), 5
    reads = _manifest_reads(monkeypatch)
    m, per_save = _filled(0), []
    tier = FastTier(local_path=node, replicas=1, durable_every=1)
    with Checkpointer(root, fast_tier=tier, retention=Retention(num_kept_partial_checkpoints=keep)) as ckpt:
        for i in range(keep + 3):
            settle.wait(i > 0)
            reads.clear()
            ckpt.save(f"s{i}", m)
            ckpt.wait()
            per_save.append(sum(p.startswith(root + "/") for p in reads))
    assert max(per_save[-3:]) <= 5, per_save


def test_records_are_kept_only_on_a_filesystem_whose_stat_is_authoritative(
    tmp_path: Any, monkeypatch: Any, settle: Settle
) -> None:
    """rev61e F1: a kept record's stale ``order`` or ``abandoned`` ranges (never re-read) could still decide a
    removal where a stat hides another host's write (an NFS client's attribute cache). Records are kept only
    on filesystems whose stat tells at once (``coherent_device``: local ones, Lustre): elsewhere every
    retention reads every manifest, as before the cache."""
    assert _fs.coherent_device(os.stat(tmp_path).st_dev)  # this machine's tmp: ext4 or tmpfs
    assert not _fs.coherent_device(os.stat("/proc").st_dev)  # procfs: not among them
    monkeypatch.setattr(_fs, "coherent_device", lambda dev: False)  # as on an NFS mount
    root, keep = str(tmp_path), 3
    reads = _manifest_reads(monkeypatch)
    m, per_save = _filled(0), []
    for i in range(keep + 3):
        settle.wait(i > 0)
        reads.clear()
        save_checkpoint(root, f"s{i}", model=m, num_kept_partial_checkpoints=keep)
        per_save.append(len(reads))
    assert per_save[-1] >= keep + 2, per_save  # every kept manifest read again


@pytest.mark.parametrize("tag", ["step1", None])
def test_a_resume_parses_the_manifest_once(tmp_path: Any, monkeypatch: Any, tag: str | None) -> None:
    # rank 0 chose the checkpoint from its manifest (resolve_target) and the reader parsed the same bytes again
    # (hunt66b r5: a 50,013-file manifest, parsed twice per resume); the reader still reads the file, and
    # reuses the parse only for the very bytes it was made from
    from smpckpt.storage.format.manifest import Manifest

    root = str(tmp_path / "ck")
    for step in range(2):
        torch.manual_seed(step)
        save_checkpoint(root, f"step{step}", model=nn.Linear(3, 2))
    parsed: list[bytes] = []
    real = Manifest.from_bytes.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, data: bytes, **kwargs: Any) -> Manifest:
        found = real(cls, data, **kwargs)
        if kwargs.get("known") is not found:  # a new parse, not the one passed on
            parsed.append(data)
        return found  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "from_bytes", classmethod(counted))
    fresh = nn.Linear(3, 2)
    resume_from_checkpoint(root, tag=tag, model=fresh)
    torch.manual_seed(1)
    for k, v in nn.Linear(3, 2).state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # a tag-less resume's listing parses each committed tag's once (step0 and step1), the reader none again
    assert len(parsed) == (1 if tag else 2), [json.loads(p)["save_id"] for p in parsed]
    # rank 0 keeps the parse; the Target the other ranks get (pickled) holds none of it
    import pickle

    from smpckpt.api._resume import resolve_target

    target = resolve_target(root, tag, None)
    assert target is not None and target.manifest is not None and target.manifest.save_id
    sent = pickle.loads(pickle.dumps(target))
    assert sent.manifest is None and sent == target
