"""FsspecStorageReader against damaged and crafted checkpoints.

* A failed load leaves nothing behind: no pooled read buffers, no destination tensors, no reader, even
  while the caller keeps the error.
* The metadata's storage records are checked before any byte is read: a file name must stay inside the
  checkpoint folder (:class:`UnsafeCheckpoint`), be listed in the manifest of a committed checkpoint, and
  offset/length must lie inside that file (:class:`CheckpointCorrupt` naming file and key).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import posixpath
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import assert_state_equal, make_state, save, unwrap, zeros_like_state
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint
from smpckpt.storage import MANIFEST_NAME, FsspecStorageReader, FullArtifactWriter, Manifest, open_fs
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.read._fetch import BufferPool

Backend = tuple[str, dict[str, Any]]

MiB = 1 << 20


# -- helpers ---------------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _load_fails(template: dict[str, Any], url: str, opts: dict[str, Any] | None = None, **kw: Any) -> BaseException:
    """The root cause of a ``dcp.load`` that must fail (DCP wraps it in a CheckpointException)."""
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like_state(template), storage_reader=FsspecStorageReader(url, storage_options=opts, **kw))
    return unwrap(info.value)


def _metadata_names(fs: Any, path: str) -> list[str]:
    """The metadata files a reader may use: the manifest's per-generation copy (committed) and .metadata."""
    names = [".metadata"]
    if fs.exists(f"{path}/{MANIFEST_NAME}"):
        names.append(Manifest.from_bytes(bytes(fs.cat_file(f"{path}/{MANIFEST_NAME}"))).metadata.name)
    return names


def _record(url: str, opts: dict[str, Any], fqn: str) -> Any:
    fs, path = open_fs(url, opts)
    md = pickle.loads(bytes(fs.cat_file(f"{path}/{_metadata_names(fs, path)[-1]}")))
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    return info


def _rewrite_record(url: str, opts: dict[str, Any], fqn: str, change: Callable[[Any, int], dict[str, Any]]) -> None:
    """Replace the storage record of ``fqn`` in every metadata file by ``replace(info, **change(info, size))``
    (``size``: its data file's size) and, for a committed checkpoint, re-seal the manifest so the crafted
    metadata passes the manifest's size/digest check: what an attacker who rewrites the folder can do."""
    fs, path = open_fs(url, opts)
    names = _metadata_names(fs, path)
    data = b""
    for name in names:
        md = pickle.loads(bytes(fs.cat_file(f"{path}/{name}")))
        (index,) = [k for k in md.storage_data if k.fqn == fqn]
        info = md.storage_data[index]
        md.storage_data[index] = dataclasses.replace(info, **change(info, fs.size(f"{path}/{info.relative_path}")))
        data = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
        fs.pipe_file(f"{path}/{name}", data)
    man_path = f"{path}/{MANIFEST_NAME}"
    if fs.exists(man_path):
        m = Manifest.from_bytes(bytes(fs.cat_file(man_path)))
        m = dataclasses.replace(m, metadata=dataclasses.replace(m.metadata, size=len(data), digest=hash_bytes(data)))
        fs.pipe_file(man_path, m.to_bytes())


def _save_stock(sd: dict[str, Any], url: str, opts: dict[str, Any]) -> None:
    """A stock DCP checkpoint (no manifest: read as legacy)."""
    if url.startswith("/"):
        dcp.save(sd, storage_writer=FileSystemWriter(url))
    else:
        dcp.save(sd, storage_writer=FsspecWriter(url, sync_files=False, **opts))


def _save(kind: str, sd: dict[str, Any], url: str, opts: dict[str, Any]) -> None:
    if kind == "committed":
        save(sd, url, opts)
    else:
        _save_stock(sd, url, opts)


def _plant_outside_file(url: str, opts: dict[str, Any], name: str, data: bytes) -> None:
    """Put ``data`` where ``<folder>/<name>`` points, literally and normalized (memory:// does not resolve
    ``..``), so a reader that followed the name would find plausible bytes there."""
    fs, path = open_fs(url, opts)
    for target in {f"{path}/{name}", posixpath.normpath(f"{path}/{name}")}:
        if url.startswith("/"):
            os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.pipe_file(target, data)


# -- memory after failed loads ---------------------------------------------------------------------
def _corrupt_big_checkpoint(url: str) -> dict[str, torch.Tensor]:
    """Three 32 MiB float32 tensors; one byte in the middle of ``t1``'s bytes flipped."""
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(8 * MiB, generator=g) for i in range(3)}
    save(sd, url)
    info = _record(url, {}, "t1")
    pos = os.path.join(url, info.relative_path)
    with open(pos, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return sd


def _failed_load(url: str, dest: dict[str, torch.Tensor], direct: bool) -> BaseException:
    reader = FsspecStorageReader(url)
    if not direct:
        reader.direct_min_bytes = 1 << 62  # every item through the pooled, coalesced buffers
    with pytest.raises(CheckpointException, match=r"CheckpointCorrupt.*checksum mismatch") as info:
        dcp.load(dest, storage_reader=reader)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and "'t1'" in str(err)
    return info.value


def _fresh_dest() -> dict[str, torch.Tensor]:
    # filled, so the pages are resident: a destination kept alive shows in RSS
    return {f"t{i}": torch.full((8 * MiB,), -1.0) for i in range(3)}


def test_failed_loads_do_not_grow_memory(tmp_path: Any) -> None:
    """15 failed loads of a 96 MiB checkpoint (checksum mismatch), direct and buffered reads alternating,
    each into fresh destination tensors: RSS must not grow (it grew ~200 MiB per failed load)."""
    url = str(tmp_path / "big")
    _corrupt_big_checkpoint(url)
    for direct in (True, False):  # warm-up: thread pools, allocator, imports
        _failed_load(url, _fresh_dest(), direct)
    gc.collect()
    before = _rss()
    for i in range(15):
        _failed_load(url, _fresh_dest(), direct=bool(i % 2))
    gc.collect()
    grown = _rss() - before
    assert grown < 150 * MiB, f"RSS grew by {grown / MiB:.0f} MiB over 15 failed loads"


def test_kept_errors_do_not_hold_read_buffers(tmp_path: Any) -> None:
    """The caller keeps every error (e.g. to report them): they must not keep the 64 MiB read buffers or
    the frames that held them."""
    url = str(tmp_path / "big")
    _corrupt_big_checkpoint(url)
    dest = _fresh_dest()
    kept = [_failed_load(url, dest, direct=False)]
    gc.collect()
    before = _rss()
    kept += [_failed_load(url, dest, direct=False) for _ in range(8)]
    gc.collect()
    grown = _rss() - before
    assert len(kept) == 9
    assert grown < 150 * MiB, f"RSS grew by {grown / MiB:.0f} MiB while 8 failed loads' errors were kept"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_failed_load_releases_reader_and_destination(tmp_path: Any, direct: bool) -> None:
    url = str(tmp_path / "ckpt")
    sd = make_state(3, scale=64)  # model.w: 4 MiB, read straight into its destination when direct
    save(sd, url)
    info = _record(url, {}, "model.w")
    path = os.path.join(url, info.relative_path)
    data = bytearray(open(path, "rb").read())
    data[info.offset + 100] ^= 0x01
    open(path, "wb").write(bytes(data))

    def attempt() -> tuple[weakref.ref[Any], weakref.ref[Any]]:
        dest = zeros_like_state(sd)
        reader = FsspecStorageReader(url)
        if not direct:
            reader.direct_min_bytes = 1 << 62
        with pytest.raises(CheckpointException, match=r"checksum mismatch.*'model\.w'"):
            dcp.load(dest, storage_reader=reader)
        return weakref.ref(reader), weakref.ref(dest["model"]["w"])

    reader_ref, tensor_ref = attempt()
    gc.collect()
    assert reader_ref() is None, "a failed load keeps its reader (and whatever it holds) alive"
    assert tensor_ref() is None, "a failed load keeps the destination state dict alive"


def test_reader_holds_no_buffers_after_read(tmp_path: Any) -> None:
    url = str(tmp_path / "ckpt")
    sd = make_state(4, scale=64)
    save(sd, url)
    reader = FsspecStorageReader(url)
    reader.direct_min_bytes = 1 << 62
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=reader)
    assert_state_equal(sd, out)
    assert reader.last_read_stats is not None and reader.last_read_stats.requests > 0
    # read buffers belong to one read_data call: nothing on the reader refers to one afterwards
    assert not [v for v in vars(reader).values() if isinstance(v, (bytearray, memoryview, BufferPool))]


# -- crafted storage records -----------------------------------------------------------------------
# The full matrices run on local disk and memory://; S3 (slower per test) gets a smoke test at the end.
local_and_memory = pytest.mark.parametrize("backend", ["local", "memory"], indirect=True)


def _check_outside_name(backend: Backend, kind: str, name: str) -> None:
    base, opts = backend
    url = f"{base}/{kind}/a/ckpt"
    sd = make_state(7)
    _save(kind, sd, url, opts)
    info = _record(url, opts, "model.w")
    fs, path = open_fs(url, opts)
    if name != "..":
        # a copy of the real data file where the crafted name points: following it would load fine
        _plant_outside_file(url, opts, name, bytes(fs.cat_file(f"{path}/{info.relative_path}")))
    _rewrite_record(url, opts, "model.w", lambda info, size: {"relative_path": name})
    err = _load_fails(sd, url, opts)
    with pytest.raises(UnsafeCheckpoint, match=r"model\.w.*not a plain name inside the checkpoint folder"):
        raise err


@local_and_memory
@pytest.mark.parametrize("kind", ["committed", "legacy"])
# (one or two plain prefix folders, "sub/data.distcp", are inside the folder: prefix strategies use them)
@pytest.mark.parametrize(
    "name", ["../../outside.bin", "..", "sub/../../data.distcp", "a/b/c/data.distcp", "s p/x.bin", "\\..\\x.bin"]
)
def test_record_naming_a_file_outside_the_folder_is_unsafe(backend: Backend, kind: str, name: str) -> None:
    _check_outside_name(backend, kind, name)


def _past_end(info: Any, size: int) -> dict[str, Any]:
    return {"offset": size - info.length + 1}


CHANGES: dict[str, Callable[[Any, int], dict[str, Any]]] = {
    "negative_offset": lambda info, size: {"offset": -8},
    "huge_length": lambda info, size: {"length": 2**62},
    "past_end": _past_end,
    "offset_beyond_file": lambda info, size: {"offset": size + 4096},
    "negative_length": lambda info, size: {"length": -1},
    "float_offset": lambda info, size: {"offset": float(info.offset)},
    "str_length": lambda info, size: {"length": str(info.length)},
}


def _check_bad_range(backend: Backend, kind: str, fqn: str, change: str) -> None:
    base, opts = backend
    url = f"{base}/{kind}-{fqn}-{change}"
    sd = make_state(8)
    _save(kind, sd, url, opts)
    name = _record(url, opts, fqn).relative_path
    _rewrite_record(url, opts, fqn, CHANGES[change])
    err = _load_fails(sd, url, opts)
    with pytest.raises(CheckpointCorrupt, match=rf"{name}: key '{fqn}' is recorded at offset .* length"):
        raise err
    crafted = _record(url, opts, fqn)
    assert f"offset {crafted.offset!r}" in str(err) and f"length {crafted.length!r}" in str(err)


@local_and_memory
@pytest.mark.parametrize("kind", ["committed", "legacy"])
@pytest.mark.parametrize("fqn", ["model.w", "step"])  # a raw tensor record, an object (bytes) record
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_record_outside_its_file_is_corrupt(backend: Backend, kind: str, fqn: str, change: str) -> None:
    _check_bad_range(backend, kind, fqn, change)


@pytest.mark.s3
@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_crafted_records_on_s3(backend: Backend) -> None:
    _check_outside_name(backend, "committed", "../../outside.bin")
    _check_bad_range(backend, "legacy", "model.w", "huge_length")
    _check_bad_range(backend, "committed", "step", "negative_offset")


@local_and_memory
def test_committed_record_naming_an_unlisted_file_is_corrupt(backend: Backend) -> None:
    base, opts = backend
    url = f"{base}/ckpt"
    sd = make_state(9)
    save(sd, url, opts)
    # a plain name inside the folder, but not a data file of this generation (the metadata copy itself)
    _rewrite_record(url, opts, "model.w", lambda info, size: {"relative_path": ".metadata"})
    err = _load_fails(sd, url, opts)
    with pytest.raises(
        CheckpointCorrupt, match=r"\.metadata: data file of key 'model\.w' is not listed in the manifest"
    ):
        raise err


def test_legacy_data_files_are_stat_once_each(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    base, opts = backend
    url = f"{base}/stock"
    sd = make_state(10, scale=4)
    _save_stock(sd, url, opts)
    fs, path = open_fs(url, opts)
    md = pickle.loads(bytes(fs.cat_file(f"{path}/.metadata")))
    files = {info.relative_path for info in md.storage_data.values()}
    reader = FsspecStorageReader(url, storage_options=opts)
    calls: list[str] = []
    real_size = reader.fs.size

    def counting_size(p: str) -> Any:
        calls.append(p)
        return real_size(p)

    monkeypatch.setattr(reader.fs, "size", counting_size)
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=reader)
    assert_state_equal(sd, out)
    assert len(files) > 1 or len(md.storage_data) > 1
    assert sorted(c.rsplit("/", 1)[-1] for c in calls) == sorted(files)


@local_and_memory
def test_legacy_missing_data_file_is_corrupt(backend: Backend) -> None:
    base, opts = backend
    url = f"{base}/stock"
    sd = make_state(11)
    _save_stock(sd, url, opts)
    name = _record(url, opts, "model.w").relative_path
    fs, path = open_fs(url, opts)
    fs.rm_file(f"{path}/{name}")
    err = _load_fails(sd, url, opts)
    with pytest.raises(CheckpointCorrupt, match=rf"{name}: data file is missing"):
        raise err


@local_and_memory
@pytest.mark.parametrize("name", [["data.distcp"], 7, None])
def test_a_record_whose_file_name_is_no_string_is_unsafe(backend: Backend, name: Any) -> None:
    """(a list would break a set lookup, a number a path join: neither may get past the name check)"""
    base, opts = backend
    url = f"{base}/nostr/ckpt"
    sd = make_state(7)
    _save("committed", sd, url, opts)
    _rewrite_record(url, opts, "model.w", lambda info, size: {"relative_path": name})
    with pytest.raises(UnsafeCheckpoint, match=r"model\.w.*not a plain name inside the checkpoint folder"):
        raise _load_fails(sd, url, opts)


@pytest.mark.parametrize("fqn", ["model.w", "step"])
@pytest.mark.parametrize("change", ["past_end", "negative_offset", "huge_length"])
def test_verify_refuses_what_a_load_refuses(tmp_path: Any, fqn: str, change: str) -> None:
    """A resealed checkpoint (its manifest vouches for the crafted metadata, every checksum passes) that
    every loader refuses is not 'OK' to verify either (issue 33 item 9)."""
    from smpckpt.storage import verify_checkpoint

    url = str(tmp_path / "c")
    save(make_state(), url)
    assert verify_checkpoint(url).ok
    _rewrite_record(url, {}, fqn, CHANGES[change])
    report = verify_checkpoint(url)
    assert not report.ok and any(fqn in p for p in report.problems), report.problems
    with pytest.raises(CheckpointException):
        dcp.load(zeros_like_state(make_state()), storage_reader=FsspecStorageReader(url))


def test_verify_refuses_a_full_artifacts_index_pointing_elsewhere(tmp_path: Any) -> None:
    """A resealed index.json of a full artifact naming a file outside it: transformers would follow it."""
    import json

    from smpckpt.storage import FullOptions, verify_checkpoint

    url = str(tmp_path / "f")
    state = {"model": {f"w{i}": torch.randn(64, 64) for i in range(4)}}
    dcp.save(state, storage_writer=FullArtifactWriter(url, full=FullOptions(max_shard_size="20KB")))
    assert verify_checkpoint(url).ok
    fs, path = open_fs(url, {})
    index_path = f"{path}/model.safetensors.index.json"
    index = json.loads(fs.cat_file(index_path))
    index["weight_map"]["w0"] = "../elsewhere.safetensors"
    data = json.dumps(index).encode()
    fs.pipe_file(index_path, data)
    m = Manifest.from_bytes(bytes(fs.cat_file(f"{path}/{MANIFEST_NAME}")))
    files = tuple(
        dataclasses.replace(f, size=len(data), block_ends=(len(data),), block_digests=(hash_bytes(data),))
        if f.name == "model.safetensors.index.json"
        else f
        for f in m.files
    )
    fs.pipe_file(f"{path}/{MANIFEST_NAME}", dataclasses.replace(m, files=files).to_bytes())
    report = verify_checkpoint(url)
    assert not report.ok and any("index.json" in p for p in report.problems), report.problems


@pytest.mark.parametrize("how", ["resaved", "by_hand"])
def test_a_tag_removed_and_being_saved_again_meanwhile_is_not_called_corrupt(tmp_path: Any, how: str) -> None:
    """rev64a F1: data files in prefix folders (S3's default; ``"binary"`` here: ``0/``, ``1/``) are every
    generation's; the tag removed by another job and a new save of it writing (not committed) looked like
    files deleted by hand (the folder names matched): CheckpointCorrupt. The file names hold the save id.
    rev64d F2: the manifest, metadata and one data file deleted by hand, the others left in their prefix
    folders, read as "removed": corrupt."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from smpckpt.errors import CheckpointError
    from smpckpt.storage import FsspecStorageWriter, remove_checkpoint

    url, state = os.path.join(str(tmp_path), "s_partial"), {"w": torch.arange(64.0), "v": torch.ones(4, 4)}
    dcp.save(state, storage_writer=FsspecStorageWriter(url, prefix_strategy="binary"), no_dist=True)

    class Paused(FsspecStorageWriter):
        def finish(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("paused before its commit")

    class Meanwhile(DefaultLoadPlanner):  # runs after the metadata is read, before any data read
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            if how == "by_hand":
                files = open_fs(url)[0].find(url)
                nested = sorted(n for n in files if os.sep in os.path.relpath(n, url))
                for n in [n for n in files if os.sep not in os.path.relpath(n, url)] + nested[:1]:
                    os.unlink(n)
                return
            remove_checkpoint(url)
            with pytest.raises(CheckpointException):
                dcp.save(state, storage_writer=Paused(url, prefix_strategy="binary"), no_dist=True)
            if not any(os.sep in os.path.relpath(n, url) for n in open_fs(url)[0].find(url)):
                raise AssertionError("no prefix folder: the case is not shown")

    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like_state(state), storage_reader=FsspecStorageReader(url), planner=Meanwhile(), no_dist=True)
    err = info.value.failures[0]
    err = err[0] if isinstance(err, tuple) else err  # (exception, traceback)
    if how == "by_hand":
        assert isinstance(err, CheckpointCorrupt) and "data file is missing" in str(err), err
        return
    assert isinstance(err, CheckpointError) and not isinstance(err, CheckpointCorrupt), err
    assert f"{url} was removed" in str(err) and "load again" in str(err), err


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_a_load_whose_tag_another_save_replaces_or_removes_meanwhile_is_not_called_corrupt(
    tmp_path: Any, how: str
) -> None:
    """Another job overwrites (``overwrite=True``) or its retention removes the tag after this load read the
    metadata and before its data reads: the old generation's files are gone. That was a CheckpointCorrupt
    ("data file is missing"), though nothing is damaged and a load again works (two processes,
    /work/hunt63/hunt63b/overwrite_race.py: 15 of 190 loads)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from smpckpt import Checkpointer, SaveOptions
    from smpckpt.errors import CheckpointError
    from smpckpt.storage import remove_checkpoint

    model = torch.nn.Linear(8, 8)
    ck = Checkpointer(str(tmp_path))
    ck.save("s", model)
    url = os.path.join(str(tmp_path), "s_partial")

    class Meanwhile(DefaultLoadPlanner):  # runs after the metadata is read, before any data read
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            if how == "replaced":
                ck.save("s", model, options=SaveOptions(overwrite=True))
            else:
                remove_checkpoint(url)

    out = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=FsspecStorageReader(url), planner=Meanwhile(), no_dist=True)
    ck.close()
    err = info.value.failures[0]
    err = err[0] if isinstance(err, tuple) else err  # (exception, traceback)
    assert isinstance(err, CheckpointError) and not isinstance(err, CheckpointCorrupt), err
    assert f"{url} was {how}" in str(err) and "load again" in str(err)

    class Late(FsspecStorageReader):  # rev63d R2: replaced or removed after the manifest was read, before its metadata
        def _committed_metadata(self, manifest: Any) -> Any:
            if how == "replaced":
                with Checkpointer(str(tmp_path)) as again:
                    again.save("s", model, options=SaveOptions(overwrite=True))
            else:
                remove_checkpoint(url)
            return super()._committed_metadata(manifest)

    if how == "removed":
        with Checkpointer(str(tmp_path)) as again:
            again.save("s", model)
    with pytest.raises(CheckpointError) as caught:
        Late(url).read_metadata()
    assert not isinstance(caught.value, CheckpointCorrupt) and f"{url} was {how}" in str(caught.value), caught.value


@pytest.mark.parametrize("how", ["full removed", "full by hand", "partial by hand"])
def test_a_full_artifact_removed_meanwhile_and_files_deleted_by_hand_are_told_apart(tmp_path: Any, how: str) -> None:
    """rev63d R5: a full artifact removed by another job mid-load surfaced a raw FileNotFoundError (its reads
    were outside the partial reads' classification), and one whose model.safetensors was deleted by hand came
    out of a resume as CheckpointNotFound. R6: a partial's data files and manifest deleted by hand read as
    "removed ... (not damaged): load again". Now removed: CheckpointError "load again"; by hand: corrupt."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from smpckpt import resume_from_checkpoint, save_checkpoint
    from smpckpt.errors import CheckpointError
    from smpckpt.storage import remove_checkpoint

    model, full = torch.nn.Linear(8, 8), how.startswith("full")
    save_checkpoint(str(tmp_path), "s", model=model, partial=not full)
    url = os.path.join(str(tmp_path), "s" if full else "s_partial")
    doomed = [
        n for n in os.listdir(url) if n.endswith((".safetensors", ".distcp")) or (n == MANIFEST_NAME and not full)
    ]

    class Meanwhile(DefaultLoadPlanner):  # runs after the metadata is read, before any data read
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            if how == "full removed":
                remove_checkpoint(url)
            for name in doomed if how != "full removed" else ():
                os.remove(os.path.join(url, name))

    md = FsspecStorageReader(url).read_metadata().state_dict_metadata
    out = {
        k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.items() if isinstance(v, TensorStorageMetadata)
    }
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=FsspecStorageReader(url), planner=Meanwhile(), no_dist=True)
    err = unwrap(info.value)
    if how == "full removed":
        assert isinstance(err, CheckpointError) and not isinstance(err, CheckpointCorrupt), repr(err)
        assert f"{url} was removed" in str(err) and "load again" in str(err), err
        return
    assert isinstance(err, CheckpointCorrupt) and "data file is missing" in str(err), repr(err)
    assert any(os.path.join(url, n) in str(err) for n in doomed), (err, doomed)
    if full:  # through the API too (it named a FileNotFoundError "not found")
        with pytest.raises(CheckpointCorrupt, match=r"s/model\.safetensors: data file is missing"):
            resume_from_checkpoint(str(tmp_path), tag="s", model=torch.nn.Linear(8, 8), partial=False)
