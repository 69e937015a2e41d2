"""Reliability of the storage layer against its own sharp edges: globbing deletes, crafted file names,
racing saves, the stock ``.metadata`` copy, manifest damage and stale S3 multipart uploads.

Every check runs on real parts (files on disk, ``memory://``, a loopback moto S3 server, real
processes) and compares loaded tensors bit-exactly.

This file doubles as the worker of the two-process race (``python test_storage_reliability.py
race-worker ...``): importing torch costs seconds here, so each worker process runs every round.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from storage_faulty_proxy import FaultyProxy
from storage_helpers import assert_state_equal, make_state, roundtrip_load, unwrap, zeros_like_state
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt, CheckpointExists, UnsafeCheckpoint
from smpckpt.storage import (
    MANIFEST_NAME,
    FsspecStorageReader,
    FsspecStorageWriter,
    Manifest,
    abort_stale_uploads,
    checkpoint_state,
    last_activity,
    open_fs,
    read_manifest,
    remove_checkpoint,
    verify_checkpoint,
)
from smpckpt.storage.backends._folder import remove_files

Backend = tuple[str, dict[str, Any]]

VICTIM = b"precious bytes that no checkpoint operation may touch\n"


# -- helpers ---------------------------------------------------------------------------------------
def _save(sd: dict[str, Any], writer: FsspecStorageWriter) -> None:
    """``dcp.save`` raising the root cause instead of DCP's CheckpointException wrapper."""
    try:
        dcp.save(sd, storage_writer=writer)
    except CheckpointException as exc:
        raise unwrap(exc) from exc


def _load(template: dict[str, Any], url: str, opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load with our reader, raising the root cause of a failure (also one from read_metadata)."""
    out = zeros_like_state(template)
    reader = FsspecStorageReader(url, storage_options=opts)
    try:
        dcp.load(out, storage_reader=reader)
    except BaseException as exc:  # noqa: BLE001 - DCP wraps read_metadata errors in AssertionError
        if reader.metadata_error is not None:
            raise reader.metadata_error from exc
        if isinstance(exc, CheckpointException):
            raise unwrap(exc) from exc
        raise
    return out


_FS: dict[tuple[str, str], Any] = {}


@pytest.fixture(autouse=True)
def _fresh_fs_cache() -> Any:
    yield
    _FS.clear()


def _fs(url: str, opts: dict[str, Any]) -> tuple[Any, str]:
    """The test's own view of ``url``: one filesystem per backend and test (an S3 client costs a
    quarter second to build), its listing cache dropped so it shows what is really stored."""
    key = (url.split("://", 1)[0] if "://" in url else "file", repr(sorted(opts.items())))
    if key not in _FS:
        _FS[key] = open_fs(url, opts)[0]
    fs = _FS[key]
    fs.invalidate_cache()
    return fs, fs._strip_protocol(url).rstrip("/")


def _files(url: str, opts: dict[str, Any]) -> dict[str, bytes]:
    """Every file under ``url`` (recursively) by its path relative to ``url``, with its bytes."""
    fs, path = _fs(url, opts)
    if not fs.exists(path):
        return {}
    out = {}
    for p in fs.find(path):
        assert p.startswith(path + "/"), (p, path)
        out[p[len(path) + 1 :]] = bytes(fs.cat_file(p))
    return out


def _names(url: str, opts: dict[str, Any]) -> set[str]:
    return set(_files(url, opts))


def _committed_names(url: str, opts: dict[str, Any]) -> set[str]:
    """What a committed folder may hold: the manifest's files, its metadata copy, .metadata, the manifest."""
    m = read_manifest(url, opts)
    return {f.name for f in m.files} | {m.metadata.name, ".metadata", MANIFEST_NAME}


def _put(url: str, opts: dict[str, Any], data: bytes) -> None:
    fs, path = _fs(url, opts)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def _cat(url: str, opts: dict[str, Any]) -> bytes:
    fs, path = _fs(url, opts)
    return bytes(fs.cat_file(path))


def _rewrite_manifest(url: str, opts: dict[str, Any], change: Callable[[Manifest], Manifest]) -> None:
    """Re-seal the manifest after ``change``: a valid self-digest, as a crafted manifest would have."""
    data = _cat(f"{url}/{MANIFEST_NAME}", opts)
    crafted = change(Manifest.from_bytes(data)).to_bytes()
    assert crafted != data
    assert "manifest_xxh3_64" in json.loads(crafted)
    _put(f"{url}/{MANIFEST_NAME}", opts, crafted)


@pytest.fixture(params=["local", "memory"])
def local_or_memory(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "local":
        yield str(tmp_path), {}
        return
    import uuid

    import fsspec

    base = f"memory://smpckpt-rel-{uuid.uuid4().hex[:8]}"
    yield base, {}
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        remove_checkpoint(base)


# -- 1. deletion never globs -----------------------------------------------------------------------
def test_remove_checkpoint_never_globs(backend: Backend) -> None:
    """``remove_checkpoint("…/x*")`` removes the folder literally named ``x*`` and nothing else; the
    siblings ``x1``/``x2`` (which a glob would match) still load bit-exact. Same for ``p[12]``."""
    base, opts = backend
    root = f"{base}/runs"
    states = {name: make_state(seed) for seed, name in enumerate(["x1", "x2", "x*", "p1", "p2", "p[12]"])}
    for name, sd in states.items():
        _save(sd, FsspecStorageWriter(f"{root}/{name}", storage_options=opts, thread_count=1))
    before = _files(root, opts)
    assert {n.split("/")[0] for n in before} == set(states)

    for literal in ("x*", "p[12]"):
        remove_checkpoint(f"{root}/{literal}", opts)
        assert checkpoint_state(f"{root}/{literal}", opts) == "missing"
    after = _files(root, opts)
    # exactly the two literal folders went; every other byte is as it was
    assert after == {n: b for n, b in before.items() if n.split("/")[0] not in ("x*", "p[12]")}
    for name in ("x1", "x2", "p1", "p2"):
        assert_state_equal(states[name], roundtrip_load(states[name], f"{root}/{name}", opts))


def test_remove_files_never_globs(backend: Backend) -> None:
    base, opts = backend
    folder = f"{base}/loose"
    names = ["f1", "f2", "f*", "f?", "f[12]"]
    for n in names:
        _put(f"{folder}/{n}", opts, n.encode())
    fs, path = _fs(folder, opts)
    assert remove_files(fs, [f"{path}/f*"]) == []
    assert _files(folder, opts) == {n: n.encode() for n in ["f1", "f2", "f?", "f[12]"]}
    # several at once (the threaded path on object stores), glob characters in each
    assert remove_files(fs, [f"{path}/f[12]", f"{path}/f?", f"{path}/missing*"]) == []
    assert _files(folder, opts) == {"f1": b"f1", "f2": b"f2"}


# -- 2. crafted names never reach a delete or a read -----------------------------------------------
@pytest.mark.parametrize("where", ["file_entry", "metadata_name"])
def test_crafted_manifest_name_is_refused(local_or_memory: Backend, where: str) -> None:
    """A manifest (with a valid self-digest) naming ``../victim.txt`` is refused by the overwrite, by
    verify and by load; the victim outside the folder survives; removal works by listing."""
    base, opts = local_or_memory
    url = f"{base}/ckpt"
    victim = f"{base}/victim.txt"
    _put(victim, opts, VICTIM)
    sd = make_state(1)
    _save(sd, FsspecStorageWriter(url, storage_options=opts))

    def craft(m: Manifest) -> Manifest:
        if where == "file_entry":
            return dataclasses.replace(m, files=(dataclasses.replace(m.files[0], name="../victim.txt"),) + m.files[1:])
        return dataclasses.replace(m, metadata=dataclasses.replace(m.metadata, name="../victim.txt"))

    _rewrite_manifest(url, opts, craft)
    crafted = _files(url, opts)

    with pytest.raises(UnsafeCheckpoint, match=r"'\.\./victim\.txt' is not a plain name"):
        _save(make_state(2), FsspecStorageWriter(url, storage_options=opts, overwrite=True))
    assert _cat(victim, opts) == VICTIM
    assert _files(url, opts) == crafted  # the refused save wrote and removed nothing
    with pytest.raises(UnsafeCheckpoint, match=r"victim\.txt"):
        verify_checkpoint(url, opts)
    with pytest.raises(UnsafeCheckpoint, match=r"victim\.txt"):
        _load(sd, url, opts)

    remove_checkpoint(url, opts)
    assert checkpoint_state(url, opts) == "missing"
    assert _names(url, opts) == set()
    assert _cat(victim, opts) == VICTIM


def test_crafted_legacy_metadata_name_is_refused(tmp_path: Any) -> None:
    """A stock DCP folder whose ``.metadata`` points a record at ``../victim.txt``: overwriting it with
    our writer (which would delete the old generation's files) and verifying it are refused."""
    url = str(tmp_path / "legacy")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    sd = make_state(3)
    dcp.save(sd, storage_writer=FileSystemWriter(url))
    md_path = os.path.join(url, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    index = sorted(md.storage_data, key=lambda k: k.fqn)[0]
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../victim.txt")
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    assert checkpoint_state(url) == "legacy"
    before = _files(url, {})

    with pytest.raises(UnsafeCheckpoint, match=r"'\.\./victim\.txt' is not a plain name"):
        _save(make_state(4), FsspecStorageWriter(url, overwrite=True))
    assert victim.read_bytes() == VICTIM
    assert _files(url, {}) == before
    with pytest.raises(UnsafeCheckpoint, match=r"victim\.txt"):
        verify_checkpoint(url)


# -- 3. exclusive commit ---------------------------------------------------------------------------
class CompetitorFirst(FsspecStorageWriter):
    """Runs a complete competing save into the same folder just before writing its own metadata
    (inside finish, after every data file of this save is written and the overwrite check passed)."""

    def __init__(self, *a: Any, competitor: dict[str, Any], **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.competitor = competitor
        self.competitor_save_id: str | None = None

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        if self.competitor_save_id is None:
            rival = FsspecStorageWriter(self.url, storage_options=self.storage_options)
            _save(self.competitor, rival)
            self.competitor_save_id = rival._save_id
        super()._write_metadata(gen_name, md_bytes)


def test_racing_save_loses_cleanly(backend: Backend) -> None:
    base, opts = backend
    url = f"{base}/race"
    mine, theirs = make_state(5), make_state(6, scale=2)
    writer = CompetitorFirst(url, storage_options=opts, competitor=theirs)
    with pytest.raises(CheckpointExists, match="another save committed"):
        _save(mine, writer)
    assert writer.competitor_save_id is not None and writer._save_id != writer.competitor_save_id
    manifest = read_manifest(url, opts)
    assert manifest.save_id == writer.competitor_save_id
    assert_state_equal(theirs, _load(theirs, url, opts))
    # nothing of the losing generation is left: only the winner's files, .metadata and the manifest
    stored = _files(url, opts)
    assert set(stored) == _committed_names(url, opts)
    assert not any(writer._save_id in name for name in stored)
    # and the stock .metadata copy is the winner's
    assert stored[".metadata"] == stored[manifest.metadata.name]
    assert verify_checkpoint(url, opts).problems == ()


def _race_seed(who: int, round_: int) -> int:
    return 1000 * (who + 1) + round_


def _wait_for(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {path}")
        time.sleep(0.0005)


def _mark(path: str) -> None:
    with open(path, "w"):
        pass


class _CheckedBarrierWriter(FsspecStorageWriter):
    """Waits, after its overwrite check passed, until the other process passed its check too: both
    saves then reach the commit with the folder empty, and only the exclusive commit decides."""

    def __init__(self, *a: Any, barrier: Callable[[], None] | None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.barrier = barrier

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        out = super().prepare_global_plan(plans)
        if self.barrier is not None:
            self.barrier()
        return out


def _race_worker(who: int, base: str, sync: str, rounds: int) -> int:
    """One racer: for each round, start together with the other process (both wait for each other's
    file), save its own state to ``base/round<i>`` without overwrite and print ``RESULT <i> OK <save id>``
    or ``RESULT <i> EXISTS <message>``. Even rounds also meet after the overwrite check (a forced commit
    race); odd rounds only start together. Exit 0 after every round; anything else is a failure."""
    other = 1 - who
    for i in range(rounds):
        url = os.path.join(base, f"round{i}")
        sd = make_state(_race_seed(who, i))
        _mark(os.path.join(sync, f"start.{who}.{i}"))
        _wait_for(os.path.join(sync, f"start.{other}.{i}"))

        def barrier(i: int = i) -> None:
            _mark(os.path.join(sync, f"checked.{who}.{i}"))
            _wait_for(os.path.join(sync, f"checked.{other}.{i}"))

        writer = _CheckedBarrierWriter(url, barrier=barrier if i % 2 == 0 else None)
        try:
            _save(sd, writer)
        except CheckpointExists as exc:
            print(f"RESULT {i} EXISTS {str(exc)!r}", flush=True)
        else:
            print(f"RESULT {i} OK {writer._save_id}", flush=True)
    return 0


@pytest.mark.timeout(240)
def test_two_processes_race_one_folder(tmp_path: Any) -> None:
    """Two real processes save different states to the same folders (5 rounds, fresh folders, started
    together): per round exactly one commits, the other gets CheckpointExists, the folder loads
    bit-exact as the winner's state and none of the loser's files remain."""
    rounds = 5
    base, sync = tmp_path / "ckpts", tmp_path / "sync"
    base.mkdir()
    sync.mkdir()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "race-worker", str(who), str(base), str(sync), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for who in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=200)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for who, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"worker {who} exited {rc}:\n{out}\n{err[-4000:]}"
    results: dict[int, dict[int, tuple[str, str]]] = {}
    for who, (_rc, out, _err) in enumerate(outputs):
        for line in out.splitlines():
            if line.startswith("RESULT "):
                _, i, outcome, detail = line.split(" ", 3)
                results.setdefault(int(i), {})[who] = (outcome, detail)
    assert sorted(results) == list(range(rounds)), outputs
    for i in range(rounds):
        outcome = results[i]
        assert sorted(o for o, _ in outcome.values()) == ["EXISTS", "OK"], (i, outcome)
        (winner,) = [w for w, (o, _) in outcome.items() if o == "OK"]
        loser_msg = outcome[1 - winner][1]
        if i % 2 == 0:
            # both passed the overwrite check: the exclusive commit refused the loser
            assert "another save committed" in loser_msg, loser_msg
        url = str(base / f"round{i}")
        manifest = read_manifest(url)
        assert manifest.save_id == outcome[winner][1]
        sd = make_state(_race_seed(winner, i))
        assert_state_equal(sd, _load(sd, url))
        stored = _files(url, {})
        assert set(stored) == _committed_names(url, {}), (i, sorted(stored))
        assert stored[".metadata"] == stored[manifest.metadata.name]


# -- 4. the stock .metadata copy is written only after the commit ----------------------------------
class Boom(RuntimeError):
    pass


class FailAtCommit(FsspecStorageWriter):
    def _write_manifest(self, data: bytes) -> None:
        raise Boom("injected before the commit")


def test_failed_first_save_leaves_no_stock_metadata(local_or_memory: Backend) -> None:
    base, opts = local_or_memory
    url = f"{base}/first"
    with pytest.raises(Boom, match="injected before the commit"):
        _save(make_state(7), FailAtCommit(url, storage_options=opts))
    assert checkpoint_state(url, opts) == "uncommitted"
    stored = _names(url, opts)
    assert stored and ".metadata" not in stored and MANIFEST_NAME not in stored


def test_failed_overwrite_keeps_stock_metadata(local_or_memory: Backend) -> None:
    """The old generation stays what every reader sees: ``.metadata`` is byte-identical, our reader
    and (on local disk) stock DCP's reader load the old state bit-exact."""
    base, opts = local_or_memory
    url = f"{base}/ckpt"
    old, new = make_state(8), make_state(9, scale=2)
    _save(old, FsspecStorageWriter(url, storage_options=opts, format="torch_save"))
    before = _cat(f"{url}/.metadata", opts)
    with pytest.raises(Boom, match="injected before the commit"):
        _save(new, FailAtCommit(url, storage_options=opts, overwrite=True, format="torch_save"))
    assert _cat(f"{url}/.metadata", opts) == before
    assert checkpoint_state(url, opts) == "committed"
    assert_state_equal(old, _load(old, url, opts))
    if "://" not in url:
        out = zeros_like_state(old)
        dcp.load(out, storage_reader=FileSystemReader(url))
        assert_state_equal(old, out)


# -- 5. verify covers the manifest and the stock copy ----------------------------------------------
def _saved(base: str, opts: dict[str, Any], name: str, seed: int) -> tuple[str, dict[str, Any]]:
    url = f"{base}/{name}"
    sd = make_state(seed)
    _save(sd, FsspecStorageWriter(url, storage_options=opts, manifest_extra={"note": "abc"}))
    return url, sd


def test_verify_intact(local_or_memory: Backend) -> None:
    base, opts = local_or_memory
    url, _ = _saved(base, opts, "ok", 10)
    report = verify_checkpoint(url, opts)
    assert report.ok and report.problems == () and report.state == "committed" and report.checksummed


def test_verify_reports_damaged_manifest(local_or_memory: Backend) -> None:
    base, opts = local_or_memory
    url, sd = _saved(base, opts, "m", 11)
    mpath = f"{url}/{MANIFEST_NAME}"
    text = _cat(mpath, opts)
    assert text.count(b'"note": "abc"') == 1
    _put(mpath, opts, text.replace(b'"note": "abc"', b'"note": "abd"'))
    report = verify_checkpoint(url, opts)
    assert not report.ok
    assert len(report.problems) == 1 and MANIFEST_NAME in report.problems[0] and "checksum" in report.problems[0]
    with pytest.raises(CheckpointCorrupt, match="manifest"):
        _load(sd, url, opts)


def test_verify_reports_wrong_stock_metadata(local_or_memory: Backend) -> None:
    base, opts = local_or_memory
    url, sd = _saved(base, opts, "s", 12)
    other, _ = _saved(base, opts, "other", 13)
    foreign = _cat(f"{other}/.metadata", opts)  # a valid metadata, of another checkpoint
    assert foreign != _cat(f"{url}/.metadata", opts)
    _put(f"{url}/.metadata", opts, foreign)
    report = verify_checkpoint(url, opts)
    # a crash between the commit and the stock copy leaves this too: a warning, smpckpt loads it
    assert report.ok and report.problems == ()
    assert len(report.warnings) == 1 and report.warnings[0].startswith(".metadata: differs"), report.warnings
    # our reader follows the manifest, so the data itself is still fine
    assert_state_equal(sd, _load(sd, url, opts))


def test_verify_reports_missing_stock_metadata(local_or_memory: Backend) -> None:
    base, opts = local_or_memory
    url, sd = _saved(base, opts, "d", 14)
    fs, path = _fs(url, opts)
    fs.rm_file(f"{path}/.metadata")
    report = verify_checkpoint(url, opts)
    assert report.ok and report.problems == ()
    assert len(report.warnings) == 1 and report.warnings[0].startswith(".metadata: missing"), report.warnings
    assert_state_equal(sd, _load(sd, url, opts))


def test_manifest_without_self_digest_still_loads(local_or_memory: Backend) -> None:
    """A manifest from the previous version (no ``manifest_xxh3_64``) loads bit-exact and verifies."""
    base, opts = local_or_memory
    url, sd = _saved(base, opts, "old", 15)
    mpath = f"{url}/{MANIFEST_NAME}"
    obj = json.loads(_cat(mpath, opts))
    del obj["manifest_xxh3_64"]
    obj["extra"]["note"] = "edited"  # without a self-digest nothing notices: as before
    _put(mpath, opts, json.dumps(obj, indent=1).encode())
    assert_state_equal(sd, _load(sd, url, opts))
    assert verify_checkpoint(url, opts).problems == ()
    assert read_manifest(url, opts).extra == {"note": "edited"}


# -- 6. S3: stale multipart uploads ----------------------------------------------------------------
class UploadClockProxy(FaultyProxy):
    """A loopback proxy in front of moto that reports real multipart-upload start times.

    moto answers ListMultipartUploads with the same ``Initiated`` (2010-11-10T20:48:33Z) for every
    upload; real S3 reports when each upload was created. The proxy notes the time each
    CreateMultipartUpload answer passes through and puts it in later listings; everything else is
    forwarded byte for byte."""

    def __init__(self, upstream: str) -> None:
        import re

        self.started: dict[str, float] = {}
        self.rewritten = 0

        def stamp(match: re.Match[bytes]) -> bytes:
            block = match.group(0)
            upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", block)
            t = self.started.get(upload_id.group(1).decode()) if upload_id else None
            if t is None:
                return block
            self.rewritten += 1
            iso = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")
            return re.sub(rb"<Initiated>[^<]*</Initiated>", f"<Initiated>{iso[:-6]}Z</Initiated>".encode(), block)

        def rewrite(method: str, query: dict[str, list[str]], status: int, data: bytes) -> bytes:
            if "uploads" not in query or status != 200:
                return data
            if method == "POST":  # CreateMultipartUpload
                upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", data)
                assert upload_id is not None, data
                self.started[upload_id.group(1).decode()] = time.time()
                return data
            if method == "GET":  # ListMultipartUploads
                return re.sub(rb"<Upload>.*?</Upload>", stamp, data, flags=re.S)
            return data

        super().__init__(upstream, lambda *_: None, rewrite)


@pytest.mark.s3
def test_abort_stale_uploads_and_last_activity(s3: Backend) -> None:
    base, direct = s3
    bucket = base[len("s3://") :]
    root, folder = f"{base}/runs", f"{base}/runs/ck1"
    key_in = "runs/ck1/dead_r0_0.zzzzzzzz.smp.distcp"  # a killed save's upload inside a checkpoint under root
    key_out = "runs-old/ck1/dead_r0_0.zzzzzzzz.smp.distcp"  # shares the text "runs", not the folder
    sd = make_state(16)
    with UploadClockProxy(direct["client_kwargs"]["endpoint_url"]) as proxy:
        opts = dict(direct, client_kwargs=dict(direct["client_kwargs"], endpoint_url=proxy.url))
        _save(sd, FsspecStorageWriter(folder, storage_options=opts, thread_count=1))
        files_newest = last_activity(folder, opts)
        assert files_newest is not None and abs(files_newest - time.time()) < 60
        time.sleep(1.1)  # object times have one-second resolution: make the upload clearly newer

        fs, _ = _fs(root, opts)
        up_in = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key_in)["UploadId"]
        up_out = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key_out)["UploadId"]

        def open_uploads() -> dict[str, Any]:
            listed = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            return {u["UploadId"]: u for u in listed}

        started = open_uploads()[up_in]["Initiated"].timestamp()
        assert started == pytest.approx(proxy.started[up_in], abs=1e-3)
        assert started > files_newest + 0.5
        assert last_activity(folder, opts) == pytest.approx(started, abs=1e-3)
        assert last_activity(root, opts) == pytest.approx(started, abs=1e-3)
        assert last_activity(f"{base}/runs/empty", opts) is None

        assert abort_stale_uploads(root, 3600, opts) == []
        assert set(open_uploads()) == {up_in, up_out}
        assert abort_stale_uploads(root, 0, opts) == [f"{bucket}/{key_in}"]
        assert set(open_uploads()) == {up_out}
        # with the upload gone, the folder's activity is its files' again; the checkpoint is untouched
        assert last_activity(folder, opts) == pytest.approx(files_newest, abs=1e-3)
        assert_state_equal(sd, _load(sd, folder, opts))
        assert proxy.rewritten >= 4
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key_out, UploadId=up_out)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "race-worker":
    sys.exit(_race_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])))


def test_exclusive_create_holds_for_large_objects_on_s3(s3: Backend) -> None:
    """s3fs's pipe_file turns a >= 100 MiB write into a multipart upload without the condition;
    the commit must stay one conditional PUT at any size (a manifest that large is a ~5 TiB save)."""
    from smpckpt.storage.backends._folder import create_bytes_exclusive

    base, opts = s3
    fs, path = _fs(f"{base}/big", opts)
    first = b"a" * (101 << 20)
    create_bytes_exclusive(fs, path, first)
    with pytest.raises(FileExistsError):
        create_bytes_exclusive(fs, path, b"b" * (101 << 20))
    assert fs.cat_file(path) == first
