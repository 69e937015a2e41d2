"""Fault injection in one process: failures at chosen points of a save, disk full, S3 5xx/throttling."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import assert_state_equal, load_error, make_state, roundtrip_load, unwrap
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.storage import FsspecStorageWriter, FullArtifactWriter, checkpoint_state, open_fs, read_manifest
from smpckpt.storage.backends._sinks import Sink
from smpckpt.storage.write._base import CommitUncertain

Backend = tuple[str, dict[str, Any]]


class Boom(RuntimeError):
    pass


class FailingPlanner(DefaultSavePlanner):
    """Raises when asked for the ``fail_at``-th item's data (0: before any write; later: mid-write)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.calls += 1
        if self.calls > self.fail_at:
            raise Boom(f"injected failure at item {self.calls}")
        return super().resolve_data(write_item)


class FailBefore(FsspecStorageWriter):
    """Raises instead of writing the metadata ("metadata") or the manifest ("marker")."""

    def __init__(self, *a: Any, point: str, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.point = point

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        if self.point == "metadata":
            raise Boom("injected before metadata")
        super()._write_metadata(gen_name, md_bytes)

    def _write_manifest(self, data: bytes) -> None:
        if self.point == "marker":
            raise Boom("injected before marker")
        super()._write_manifest(data)


def _data_files(url: str, opts: dict[str, Any]) -> list[str]:
    fs, path = open_fs(url, opts)
    # names relative to the folder: on object stores data files sit in prefix folders
    return sorted(p[len(path) + 1 :] for p in fs.find(path) if p.endswith(".distcp"))


def _listing(url: str, opts: dict[str, Any]) -> list[str]:
    """Every file under the folder, relative to it ([] where it does not exist: memory and S3 have no
    empty folders)."""
    fs, path = open_fs(url, opts)
    if not fs.exists(path):
        return []
    return sorted(p[len(path) + 1 :] for p in fs.find(path))


# The message each injection point raises (FailingPlanner(0) fails on the 1st item, FailingPlanner(3) on the 4th).
_INJECTED = {
    "before_write": "injected failure at item 1",
    "mid_write": "injected failure at item 4",
    "metadata": "injected before metadata",
    "marker": "injected before marker",
}


@pytest.mark.parametrize("point", ["before_write", "mid_write", "metadata", "marker"])
def test_failed_overwrite_keeps_previous_checkpoint(backend: Backend, point: str) -> None:
    base, opts = backend
    url = f"{base}/ckpt"
    old, new = make_state(1), make_state(2, scale=3)
    dcp.save(old, storage_writer=FsspecStorageWriter(url, storage_options=opts))
    before = read_manifest(url, opts)
    if point in ("before_write", "mid_write"):
        planner: Any = FailingPlanner(0 if point == "before_write" else 3)
        writer = FsspecStorageWriter(url, storage_options=opts, overwrite=True, thread_count=1)
    else:
        planner = None
        writer = FailBefore(url, storage_options=opts, overwrite=True, point=point)
    with pytest.raises(CheckpointException, match=f"Boom: {_INJECTED[point]}") as info:
        dcp.save(new, storage_writer=writer, planner=planner)
    err = unwrap(info.value)
    if point == "marker" and base.startswith("s3"):
        # a failed commit request on an object store may still land: said so, the cause kept
        assert isinstance(err, CommitUncertain) and type(err.__cause__) is Boom, err
    else:
        assert type(err) is Boom and str(err) == _INJECTED[point]
    assert checkpoint_state(url, opts) == "committed"
    assert read_manifest(url, opts).save_id == before.save_id
    # previous generation loads bit-exact, even after ".metadata" was replaced ("marker")
    assert_state_equal(old, roundtrip_load(old, url, opts))
    if point in ("before_write", "mid_write"):
        # the failed rank removed its partial files
        assert _data_files(url, opts) == sorted(f.name for f in before.files)


@pytest.mark.parametrize("point", ["mid_write", "marker"])
def test_failed_first_save_is_refused(backend: Backend, point: str) -> None:
    base, opts = backend
    url = f"{base}/first"
    sd = make_state(3)
    if point == "mid_write":
        args: dict[str, Any] = {
            "storage_writer": FsspecStorageWriter(url, storage_options=opts),
            "planner": FailingPlanner(2),
        }
        # four writer threads share the planner: every item after the 2nd fails, and which thread's failure
        # (so which item number) the writer re-raises is a race; the message itself is pinned
        expected = r"injected failure at item \d+"
    else:
        args = {"storage_writer": FailBefore(url, storage_options=opts, point="marker")}
        expected = "injected before marker"
    with pytest.raises(CheckpointException, match=f"Boom: {expected}"):
        dcp.save(sd, **args)
    names = _listing(url, opts)
    err = load_error(sd, url, opts)
    assert type(err) is CheckpointNotFound
    # Deterministic on every backend (only the empty folder's existence differs, and it reads "missing"):
    if point == "mid_write":
        # the failing rank removed its partial data files and nothing else was written: nothing is left
        # (an empty folder on local disk; no objects at all on memory:// and S3)
        assert names == []
        assert checkpoint_state(url, opts) == "missing"
        assert str(err) == f"no checkpoint at {url}"
    else:
        # every data file and the generation's metadata are durable, the manifest (commit marker) is not
        data = [n for n in names if n.endswith(".smp.distcp")]
        gen_md = [n for n in names if n.startswith(".metadata.")]
        assert data and len(gen_md) == 1, names
        assert set(names) == set(data) | set(gen_md), names  # no manifest, no stock .metadata copy
        assert checkpoint_state(url, opts) == "uncommitted"
        assert str(err).startswith(
            f"{url} holds an uncommitted (incomplete or failed) save: {len(names)} file(s) "
            "but no smpckpt.manifest.json and no .metadata"
        ), str(err)


@pytest.mark.parametrize("point", ["metadata", "marker"])
def test_discard_failed_save_removes_that_saves_files_only(backend: Backend, point: str) -> None:
    """After a failed overwrite, ``discard_failed_save`` leaves exactly the committed generation (and
    no emptied prefix folder). (A rank failing mid-write removes its own files at once; the other
    ranks' complete files are the two-rank test's case, tests/storage/test_storage_dist.py.) A failed
    commit request on S3 may still land: then nothing is removed."""
    base, opts = backend
    url = f"{base}/discard"
    old = make_state(1)
    dcp.save(old, storage_writer=FsspecStorageWriter(url, storage_options=opts))
    committed = set(_listing(url, opts))
    # every data file is durable when the failure comes; at "marker" the metadata copy too
    writer = FailBefore(url, storage_options=opts, overwrite=True, point=point, prefix_strategy="hex")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2, scale=3), storage_writer=writer)
    left = set(_listing(url, opts)) - committed
    assert any(n.endswith(".smp.distcp") for n in left), left  # the failed save did leave files
    assert writer.discard_failed_save(info.value) == []
    if point == "marker" and base.startswith("s3"):
        # uncertain commit: kept. The stock copy of the generation it may replace went before the swap and
        # is not put back: should the request land later, that copy would describe the replaced generation
        assert set(_listing(url, opts)) == (committed - {".metadata"}) | left
        return
    assert set(_listing(url, opts)) == committed
    if not base.startswith(("s3", "memory")):  # local: the prefix folders it made are gone too
        fs, path = open_fs(url, opts)
        assert sorted(os.listdir(path)) == sorted(committed)
    assert_state_equal(old, roundtrip_load(old, url, opts))
    assert writer.discard_failed_save(info.value) == []  # nothing recorded any more


def test_discard_leaves_everything_when_the_folder_cannot_be_read(tmp_path: Any) -> None:
    url = str(tmp_path / "unreadable")
    writer = FailBefore(url, point="metadata")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2), storage_writer=writer)
    left = _listing(url, {})
    assert left
    (tmp_path / "unreadable" / "smpckpt.manifest.json").write_text("{not json")  # someone else's, damaged
    not_removed = {os.path.basename(p) for p in writer.discard_failed_save(info.value)}
    assert not_removed >= set(left)  # every file reported as not removed
    assert _listing(url, {}) == sorted([*left, "smpckpt.manifest.json"])


@pytest.mark.parametrize("existed", [False, True])
def test_discard_removes_the_folder_only_if_the_save_made_it(tmp_path: Any, existed: bool) -> None:
    folder = tmp_path / "made"
    if existed:
        folder.mkdir()  # the user's, before the save
    writer = FailBefore(str(folder), point="metadata")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2), storage_writer=writer)
    assert writer.discard_failed_save(info.value) == []
    assert folder.exists() is existed and (not existed or not list(folder.iterdir()))


def test_discard_after_a_commit_removes_nothing(backend: Backend) -> None:
    """The guard: a save whose manifest landed is never discarded, whatever the caller believes."""
    base, opts = backend
    url = f"{base}/kept"
    sd = make_state(3)
    writer = FsspecStorageWriter(url, storage_options=opts)
    dcp.save(sd, storage_writer=writer)
    files = _listing(url, opts)
    assert writer.discard_failed_save() == []
    assert _listing(url, opts) == files
    assert_state_equal(sd, roundtrip_load(sd, url, opts))


class DiskFullSink:
    """Wraps a sink; raises ENOSPC once more than ``limit`` bytes were written."""

    def __init__(self, inner: Sink, limit: int) -> None:
        self.inner, self.limit, self.n, self.path = inner, limit, 0, inner.path
        self.aborted = False

    def write(self, data: memoryview) -> None:
        self.n += data.nbytes
        if self.n > self.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        self.inner.write(data)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.aborted = True
        self.inner.abort()


class DiskFullWriter(FsspecStorageWriter):
    def _open_sink(self, name: str) -> Sink:
        return DiskFullSink(super()._open_sink(name), limit=20_000)


def test_disk_full(tmp_path: Any) -> None:
    url = str(tmp_path / "full")
    old = make_state(4)
    dcp.save(old, storage_writer=FsspecStorageWriter(url))
    with pytest.raises(CheckpointException, match=re.escape(os.strerror(errno.ENOSPC))) as info:
        dcp.save(make_state(5, scale=4), storage_writer=DiskFullWriter(url, overwrite=True))
    err = unwrap(info.value)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert_state_equal(old, roundtrip_load(old, url))
    assert len(_data_files(url, {})) == len(read_manifest(url).files)


def test_use_collectives_false_is_refused_when_multi_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    w = FsspecStorageWriter(str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="does not support use_collectives=False in a multi-rank job"):
        w.set_up_storage_writer(True, rank=0, use_collectives=False)
    w.set_up_storage_writer(True, rank=0, use_collectives=True)


# -- S3 faults on the wire ---------------------------------------------------------------------------
def _proxy_opts(opts: dict[str, Any], proxy_url: str, attempts: int) -> dict[str, Any]:
    new = dict(opts)
    new["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy_url)
    new["config_kwargs"] = {"retries": {"max_attempts": attempts, "mode": "standard"}}
    return new


def _big_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(6 << 20, generator=g), "b": torch.randn(1000, generator=g), "n": 5}  # 24 MiB + small


@pytest.mark.s3
def test_s3_throttling_and_5xx_are_retried(s3: Backend, moto_endpoint: str) -> None:
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    counts: dict[str, int] = {"part": 0, "put": 0}

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "PUT" and "partNumber" in query:
            counts["part"] += 1
            return 503 if counts["part"] <= 2 else None  # SlowDown twice
        if method == "PUT" and "uploadId" not in query and path.endswith(".json"):
            counts["put"] += 1
            return 500 if counts["put"] == 1 else None  # InternalError on the commit PUT
        return None

    sd = _big_state()
    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        popts = _proxy_opts(opts, proxy.url, attempts=5)
        dcp.save(
            sd,
            storage_writer=FsspecStorageWriter(
                f"{base}/retry", storage_options=popts, part_size=16 << 20, thread_count=1
            ),
        )
        assert len(proxy.injected) == 3, proxy.injected
    assert_state_equal(sd, roundtrip_load(sd, f"{base}/retry", opts))


@pytest.mark.s3
def test_s3_persistent_errors_fail_and_abort_uploads(s3: Backend, moto_endpoint: str) -> None:
    import boto3
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    old = make_state(8)
    dcp.save(old, storage_writer=FsspecStorageWriter(f"{base}/p", storage_options=opts))

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        return 500 if method == "PUT" and query.get("partNumber") == ["2"] else None

    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        popts = _proxy_opts(opts, proxy.url, attempts=2)
        with pytest.raises(CheckpointException, match="We encountered an internal error") as info:
            dcp.save(
                _big_state(),
                storage_writer=FsspecStorageWriter(
                    f"{base}/p", storage_options=popts, overwrite=True, part_size=16 << 20, thread_count=1
                ),
            )
        # only part 2 of the one multipart upload failed, and it was retried (botocore's attempts, and s3fs
        # may add its own) before the save gave up
        assert len(proxy.injected) >= 2, proxy.injected
        assert all(m == "PUT" and "partNumber=2" in path and code == 500 for m, path, code in proxy.injected)
    err = unwrap(info.value)
    # s3fs translates S3's 500 InternalError into OSError(EREMOTEIO, <S3's message>)
    assert type(err) is OSError and err.errno == errno.EREMOTEIO, repr(err)
    assert err.strerror == "We encountered an internal error. Please try again."
    assert str(err.filename).endswith(".distcp"), err.filename  # the object whose upload failed is named
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    assert not client.list_multipart_uploads(Bucket=base[5:]).get("Uploads")
    assert_state_equal(old, roundtrip_load(old, f"{base}/p", opts))


def _committed_through_one_fault(
    opts: dict[str, Any], endpoint: str, fail_after: Any, sd: dict[str, Any], url: str, writer: Any, **kw: Any
) -> None:
    """Save ``sd`` to ``url`` through a proxy that injects exactly one fault (``fail_after``): committed, loading
    back bit-exactly, and (a full save) without its in-progress marker."""
    from storage_faulty_proxy import FaultyProxy

    with FaultyProxy(endpoint, lambda *_: None, fail_after=fail_after) as proxy:
        dcp.save(sd, storage_writer=writer(url, storage_options=_proxy_opts(opts, proxy.url, attempts=3), **kw))
        assert len(proxy.injected) == 1, proxy.injected
    assert checkpoint_state(url, opts) == "committed"
    fs, path = open_fs(url, opts)
    assert not fs.exists(f"{path}/smpckpt.writing")
    assert_state_equal(sd, roundtrip_load(sd, url, opts))


def _first_put_lost(suffix: str) -> tuple[Callable[[str, str, dict[str, list[str]]], int | None], list[str]]:
    """A proxy's ``fail_after`` answering 500 to the first PUT of a key ending in ``suffix`` once it landed (its
    reply lost), and the list of what it hit."""
    landed: list[str] = []

    def fail_after(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "PUT" and path.endswith(suffix) and not landed:
            landed.append(path)
            return 500
        return None

    return fail_after, landed


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["partial", "full"])
def test_s3_a_commit_whose_reply_was_lost_is_committed(s3: Backend, moto_endpoint: str, mode: str) -> None:
    """The conditional manifest PUT lands but its reply is lost (500): the client retries, and the
    retry is refused (412) by the save's own manifest. That is this save's commit, not another's: the
    full mode reported "another save committed here" and kept its in-progress marker."""

    base, opts = s3
    fail_after, _ = _first_put_lost("/smpckpt.manifest.json")
    sd = make_state(2)
    url = f"{base}/lost-{mode}"
    writer = FullArtifactWriter if mode == "full" else FsspecStorageWriter
    _committed_through_one_fault(opts, moto_endpoint, fail_after, sd, url, writer)


@pytest.mark.s3
@pytest.mark.parametrize("request_lost", ["put", "complete"])
def test_s3_a_data_file_whose_create_reply_was_lost_is_this_saves_own(
    s3: Backend, moto_endpoint: str, request_lost: str
) -> None:
    """A data file's create-only PUT (or multipart completion) lands and its reply is lost: the retry is refused
    (412) by the save's own object. The save failed, on a transient error, with a FileExistsError naming no key.
    The completion's 412 is sent here after the real completion (moto answers a retried completion 200, so
    the retry would never meet the refusal S3 sends: rev68c F4); the object's multipart ETag tells it is ours."""

    base, opts = s3
    landed: list[str] = []

    def fail_after(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        put = method == "PUT" and "partNumber" not in query
        complete = method == "POST" and "uploadId" in query
        if path.endswith(".distcp") and not landed and (put if request_lost == "put" else complete):
            landed.append(path)
            return 500 if request_lost == "put" else 412
        return None

    sd, url = _big_state(), f"{base}/lost-{request_lost}"
    _committed_through_one_fault(opts, moto_endpoint, fail_after, sd, url, FsspecStorageWriter, part_size=16 << 20)


@pytest.mark.s3
@pytest.mark.parametrize("name", ["smpckpt.writing", "n.pt"])
def test_s3_a_full_saves_small_object_whose_create_reply_was_lost_is_its_own(
    s3: Backend, moto_endpoint: str, name: str
) -> None:
    """A full save's in-progress marker (or an object value's file) lands and its reply is lost: the retry is
    refused by the save's own object. The save failed: "another full save started writing here at the same
    moment" (its own marker, left behind) or a FileExistsError."""

    base, opts = s3
    fail_after, _ = _first_put_lost(f"/{name}")
    sd, url = make_state(3), f"{base}/full-lost"
    sd["n"] = 5
    _committed_through_one_fault(opts, moto_endpoint, fail_after, sd, url, FullArtifactWriter)


@pytest.mark.s3
def test_s3_a_data_file_refused_by_another_object_names_its_key(s3: Backend) -> None:
    from smpckpt.storage.backends._s3 import S3MultipartSink

    base, opts = s3
    fs, path = open_fs(f"{base}/taken.distcp", opts)
    fs.pipe_file(path, b"another save's")
    for size in (1 << 20, 11 << 20):  # one PutObject; a multipart upload of 5 MiB parts
        sink = S3MultipartSink(fs, path, part_size=5 << 20, max_in_flight=2)
        sink.write(memoryview(bytes(size)))
        with pytest.raises(FileExistsError) as info:
            sink.commit()
        assert info.value.filename == path, repr(info.value)
    assert fs.cat_file(path) == b"another save's"


@pytest.mark.s3
@pytest.mark.parametrize("reads", ["ok", "failing"])
def test_s3_an_overwrite_whose_manifest_reply_was_lost_keeps_its_files(
    s3: Backend, moto_endpoint: str, reads: str
) -> None:
    """rev68c F1: an overwrite's ``If-Match`` manifest PUT lands, its reply is lost (500) and the retry is refused
    (412) by that manifest, ours. Every 412 was "another save replaced it": with the manifest's GETs failing too,
    the commit read no save id and removed this save's files under its own committed manifest (old generation
    gone too, the checkpoint unloadable). Ours is recognised by its bytes; a failed read is an uncertain commit."""
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    url, old, new = f"{base}/ow-lost-{reads}", make_state(4), make_state(5)
    dcp.save(old, storage_writer=FsspecStorageWriter(url, storage_options=opts))
    fail_after, landed = _first_put_lost("/smpckpt.manifest.json")

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        return 500 if reads == "failing" and landed and method == "GET" and path.endswith(".json") else None

    with FaultyProxy(moto_endpoint, should_fail, fail_after=fail_after) as proxy:
        w = FsspecStorageWriter(url, storage_options=_proxy_opts(opts, proxy.url, attempts=3), overwrite=True)
        if reads == "ok":
            dcp.save(new, storage_writer=w)
        else:
            with pytest.raises(CheckpointException) as info:
                dcp.save(new, storage_writer=w)
            err = unwrap(info.value)
            assert isinstance(err, CommitUncertain) and url in str(err), repr(err)
            assert "files are kept" in str(err) and "smpckpt.manifest.json" in str(err), str(err)
    assert checkpoint_state(url, opts) == "committed"
    assert_state_equal(new, roundtrip_load(new, url, opts))  # ours landed: the new generation, whole


@pytest.mark.s3
def test_s3_a_refused_commit_whose_manifest_cannot_be_read_keeps_its_files(s3: Backend, moto_endpoint: str) -> None:
    """rev68c F1, the commit's half: another save's manifest replaces the one this overwrite saw (its ``If-Match``
    PUT refused), then every read of the manifest fails. The commit took the failed read for another save id and
    removed this save's files: they go only once a manifest naming another save was actually read."""
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    url, other_url = f"{base}/ow-taken", f"{base}/ow-other"
    dcp.save(make_state(4), storage_writer=FsspecStorageWriter(url, storage_options=opts))
    dcp.save(make_state(6), storage_writer=FsspecStorageWriter(other_url, storage_options=opts))
    fs, path = open_fs(url, opts)
    other = fs.cat_file(f"{open_fs(other_url, opts)[1]}/smpckpt.manifest.json")
    before = set(_listing(url, opts))
    state = {"planted": False, "gets": 0}

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "PUT" and path.endswith("/smpckpt.manifest.json") and not state["planted"]:
            fs.pipe_file(f"{path.lstrip('/')}", other)  # the other save's commit lands just before ours
            state["planted"] = True
        elif method == "GET" and path.endswith("/smpckpt.manifest.json") and state["planted"]:
            state["gets"] += 1
            return 500 if state["gets"] > 1 else None  # replace_if's own check reads it; then reads fail
        return None

    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        w = FsspecStorageWriter(url, storage_options=_proxy_opts(opts, proxy.url, attempts=2), overwrite=True)
        with pytest.raises(CheckpointException) as info:
            dcp.save(make_state(5), storage_writer=w)
    err = unwrap(info.value)
    assert isinstance(err, CommitUncertain) and "files are kept" in str(err), repr(err)
    assert "smpckpt.manifest.json" in str(err), str(err)
    fs.invalidate_cache()
    assert fs.cat_file(f"{path}/smpckpt.manifest.json") == other
    mine = set(_listing(url, opts)) - before
    assert {n for n in mine if n.endswith(".distcp")} and {n for n in mine if n.startswith(".metadata.")}, mine


@pytest.mark.s3
def test_s3_a_commit_whose_removal_check_fails_says_it_may_be_committed(
    s3: Backend, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hunt64b F3: the manifest PUT lands, then S3 goes down for the commit's GET of the removal mark: the save
    failed with a bare OSError naming ``smpckpt.removing`` though it was committed (its retry under the tag then
    met ``CheckpointExists``). Now it is :class:`CommitUncertain`, saying so, and the save's files are kept."""
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    url = f"{base}/down"
    landed: list[str] = []

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "PUT" and path.endswith("/smpckpt.manifest.json"):
            landed.append(path)
        return 503 if landed and path.endswith("/smpckpt.removing") else None

    sd = make_state(2)
    # S3 stays down for that key: s3fs's own 5 tries of each SlowDown GET (1.9 s of sleeps apiece, on top of
    # botocore's 2 attempts) only delayed the same failure (10 s of the suite); one s3fs try, same outcome
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        with pytest.raises(CheckpointException) as info:
            dcp.save(sd, storage_writer=FsspecStorageWriter(url, storage_options=_proxy_opts(opts, proxy.url, 2)))
    err = unwrap(info.value)
    assert isinstance(err, CommitUncertain) and url in str(err) and "smpckpt ls" in str(err), repr(err)
    assert checkpoint_state(url, opts) == "committed"
    assert_state_equal(sd, roundtrip_load(sd, url, opts))


@pytest.mark.s3
def test_s3_a_manifest_get_cut_short_once_is_retried(s3: Backend, moto_endpoint: str) -> None:
    """A manifest GET whose body is cut off once is read again: it made a committed checkpoint look
    unreadable, and a resume then fell back to an older tag."""
    from storage_faulty_proxy import FaultyProxy

    base, opts = s3
    url = f"{base}/cut"
    dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url, storage_options=opts))
    cuts: list[str] = []

    def cut_body(method: str, path: str, query: dict[str, list[str]]) -> bool:
        if method == "GET" and path.endswith("/smpckpt.manifest.json") and not cuts:
            cuts.append(path)
            return True
        return False

    with FaultyProxy(moto_endpoint, lambda *_: None, cut_body=cut_body) as proxy:
        manifest = read_manifest(url, _proxy_opts(opts, proxy.url, attempts=3))
    assert cuts and manifest.save_id == read_manifest(url, opts).save_id


@pytest.mark.s3
def test_s3_an_unreadable_newest_is_not_skipped(s3: Backend, moto_endpoint: str) -> None:
    """``newest`` names a checkpoint whose manifest cannot be read (persistent 500s): an I/O error says
    nothing against it, so the resume fails naming it instead of silently taking the older one."""
    from storage_faulty_proxy import FaultyProxy

    from smpckpt import resume_from_checkpoint, save_checkpoint

    base, opts = s3
    root = f"{base}/unreadable-newest"
    model = torch.nn.Linear(3, 2)
    save_checkpoint(root, "t1", model=model, storage_options=opts)
    with torch.no_grad():
        model.weight.add_(1.0)
    want = model.weight.clone()
    save_checkpoint(root, "t2", model=model, storage_options=opts)

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        return 500 if method == "GET" and path.endswith("/t2_partial/smpckpt.manifest.json") else None

    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        with pytest.raises(CheckpointError, match=r"newest names 't2', which could not be read .*not falling back"):
            resume_from_checkpoint(root, model=model, storage_options=_proxy_opts(opts, proxy.url, attempts=2))
    fresh = torch.nn.Linear(3, 2)
    resume_from_checkpoint(root, model=fresh, storage_options=opts)  # readable again: t2, not t1
    assert torch.equal(fresh.weight, want)
