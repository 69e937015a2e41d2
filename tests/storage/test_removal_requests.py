"""Removal at scale on S3 (a loopback proxy in front of moto counts the requests on the wire): a checkpoint's
files go in one DeleteObjects, the manifest before them and the removal mark after them in steps of their
own; a key S3 reports failed inside DeleteObjects' 200 reply is named, and the next retention finishes the
removal. The kept checkpoints resume bit-exactly."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from s3_env import reset_moto, s3_options
from storage_faulty_proxy import FaultyProxy
from torch import nn

from smpckpt import resume_from_checkpoint, save_checkpoint
from smpckpt.catalog.root import scan_root
from smpckpt.storage import open_fs

BUCKET = "smpckpt-removals"

pytestmark = pytest.mark.s3


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _assert_resumes(root: str, opts: dict[str, Any], tag: str, seed: int) -> None:
    fresh = _model(1000 + seed)
    resume_from_checkpoint(root, tag=tag, model=fresh, storage_options=opts)
    for k, v in _model(seed).state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), (tag, k)


def _states(root: str, opts: dict[str, Any]) -> dict[str, str]:
    return {r.tag: r.state for r in scan_root(root, storage_options=opts)}


def test_a_checkpoint_is_removed_in_one_delete_objects_manifest_first_mark_last(moto_endpoint: str) -> None:
    reset_moto(moto_endpoint, BUCKET)
    seen: list[tuple[str, str, str]] = []

    def record(method: str, path: str, query: dict[str, list[str]]) -> None:
        seen.append((method, path, "delete" if "delete" in query else ""))

    with FaultyProxy(moto_endpoint, record) as proxy:  # type: ignore[arg-type]
        opts, root = s3_options(proxy.url), f"s3://{BUCKET}/run"
        for step in range(3):
            save_checkpoint(root, f"step{step}", model=_model(step), storage_options=opts)
        fs, path = open_fs(f"{root}/step0_partial", opts)
        files = fs.find(path)
        assert len(files) >= 4, files  # data, metadata, stock copy, manifest
        seen.clear()
        save_checkpoint(root, "step3", model=_model(3), storage_options=opts, num_kept_partial_checkpoints=2)
        # per checkpoint removed, in this order: DELETE manifest, one DeleteObjects (POST ?delete), DELETE mark
        deletes = ["DeleteObjects" if q else p.split("/run/")[-1] for m, p, q in seen if m == "DELETE" or q == "delete"]
        steps = ["smpckpt.manifest.json", "DeleteObjects", "smpckpt.removing"]
        # two removals run at once (a backlog on S3 goes 8 at a time): each folder's own requests keep their order
        posts = [i for i, (m, p, q) in enumerate(seen) if q == "delete"]
        for tag in ("step0", "step1"):
            mine = [
                (i, p.split("/")[-1]) for i, (m, p, q) in enumerate(seen) if m == "DELETE" and f"/{tag}_partial/" in p
            ]
            assert [name for _, name in mine] == steps[::2], (tag, deletes)
            assert any(mine[0][0] < i < mine[1][0] for i in posts), (tag, deletes)  # its DeleteObjects in between
        assert len(posts) == 2, deletes
        assert _states(root, opts) == {"step2": "committed", "step3": "committed"}
        for step in (2, 3):
            _assert_resumes(root, opts, f"step{step}", step)


def test_a_key_s3_reports_failed_inside_delete_objects_is_named_and_the_next_save_finishes(
    moto_endpoint: str, caplog: Any
) -> None:
    reset_moto(moto_endpoint, BUCKET)
    victim: list[str] = []

    def rewrite(method: str, query: dict[str, list[str]], status: int, body: bytes) -> bytes:
        if method == "POST" and "delete" in query and victim and status == 200:
            key = victim.pop()
            err = f"<Error><Key>{key}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            return re.sub(rb"</DeleteResult>", err.encode() + b"</DeleteResult>", body)
        return body

    with FaultyProxy(moto_endpoint, lambda *a: None, rewrite=rewrite) as proxy:
        opts, root = s3_options(proxy.url), f"s3://{BUCKET}/run"
        for step in range(2):
            save_checkpoint(root, f"step{step}", model=_model(step), storage_options=opts)
        fs, path = open_fs(f"{root}/step0_partial", opts)
        data = sorted(f for f in fs.find(path) if f.endswith(".distcp"))
        victim.append(data[0].partition("/")[2])  # the key, without the bucket
        with caplog.at_level(logging.WARNING):
            # keep 2: one removal, so the reply rewritten is that removal's (two run at once on S3)
            save_checkpoint(root, "step2", model=_model(2), storage_options=opts, num_kept_partial_checkpoints=2)
        text = caplog.text
        assert f"{data[0]} not removed: AccessDenied" in text, text
        # retention's warning names the folder and the key (remove_checkpoint raises naming both)
        assert re.search(r"could not remove .*step0_partial.*will retry on the next save.*" + re.escape(data[0]), text)
        # the manifest went first and the mark stays: the folder is a removal to finish, never committed
        states = _states(root, opts)
        assert states == {"step0": "removing", "step1": "committed", "step2": "committed"}, states
        save_checkpoint(root, "step3", model=_model(3), storage_options=opts, num_kept_partial_checkpoints=2)
        assert _states(root, opts) == {"step2": "committed", "step3": "committed"}
        for step in (2, 3):
            _assert_resumes(root, opts, f"step{step}", step)


def test_a_backlog_of_removals_on_s3_runs_several_at_once_each_in_its_own_order(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # retention turned on over a root holding many saves removes them all after one save: ~8 requests each,
    # one at a time, took minutes for 1,000 (hunt66b r1/r4); the removals are independent folders
    import threading
    import time

    from smpckpt.catalog import root as catalog_root

    reset_moto(moto_endpoint, BUCKET)
    opts, root = s3_options(moto_endpoint), f"s3://{BUCKET}/run"
    for step in range(2):
        save_checkpoint(root, f"step{step}", model=_model(step), storage_options=opts)
    lock, running, most = threading.Lock(), [0], [0]
    real = catalog_root.remove_checkpoint

    def counted(*args: Any, **kwargs: Any) -> bool:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.2)  # a real endpoint's latency: lets the removals meet
            return bool(real(*args, **kwargs))
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(catalog_root, "remove_checkpoint", counted)
    save_checkpoint(root, "step2", model=_model(2), storage_options=opts, num_kept_partial_checkpoints=1)
    assert most[0] == 2, f"{most[0]} removal(s) in flight at most"  # step0's and step1's
    assert _states(root, opts) == {"step2": "committed"}
    _assert_resumes(root, opts, "step2", 2)


def test_a_damaged_newest_is_named_once_by_a_pass_removing_several_on_s3(
    moto_endpoint: str, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rev63f F2's once per pass, with removals that run side by side on object stores (each reads newest again)
    import time

    from smpckpt.catalog import root as catalog_root

    real_warning = catalog_root.log.warning

    def slow_warning(*args: Any) -> None:
        time.sleep(0.2)  # a slow log handler: removals side by side would all pass the "said already?" check
        real_warning(*args)

    monkeypatch.setattr(catalog_root.log, "warning", slow_warning)

    reset_moto(moto_endpoint, BUCKET)
    opts, root = s3_options(moto_endpoint), f"s3://{BUCKET}/run"
    for step in range(4):
        save_checkpoint(root, f"step{step}", model=_model(step), storage_options=opts)
    fs, path = open_fs(root, opts)
    fs.pipe_file(f"{path}/newest", b"bad tag!\n")
    with caplog.at_level(logging.WARNING):
        result = catalog_root.apply_retention(root, 1, storage_options=opts)
    assert result.removed == ("step0", "step1", "step2"), result
    said = [
        r.getMessage() for r in caplog.records if "newest" in r.getMessage() and "not a valid tag" in r.getMessage()
    ]
    assert len(said) == 1, said
    _assert_resumes(root, opts, "step3", 3)


def _killed_saves(endpoint: str, marked: tuple[str, ...] = ("k1",), count: int = 3) -> None:
    """``count`` folders of killed saves (a data file each, no manifest); ``marked``: an interrupted removal's."""
    import boto3

    reset_moto(endpoint, BUCKET)
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for i in range(count):
        c.put_object(Bucket=BUCKET, Key=f"run/k{i}_partial/b9ec_r0_0.1a22c1fea581bc14902.smp.distcp", Body=b"x")
    for tag in marked:
        c.put_object(Bucket=BUCKET, Key=f"run/{tag}_partial/smpckpt.removing", Body=b"x")


def test_scan_root_reads_an_uncommitted_folder_in_at_most_3_requests(moto_endpoint: str) -> None:
    # a killed save's folder: GET manifest (404), GET .metadata (404), one LIST, which also shows the removal
    # mark; HEAD smpckpt.removing and s3fs's exists() LIST after it were redundant (hunt66b r4: 5,005 requests
    # for 1,000 such folders, each tag-less resume and every retention pass)
    _killed_saves(moto_endpoint)
    seen: list[tuple[str, str]] = []
    with FaultyProxy(moto_endpoint, lambda m, p, q: seen.append((m, p)) and None) as proxy:  # type: ignore[arg-type]
        states = {r.tag: r.state for r in scan_root(f"s3://{BUCKET}/run", storage_options=s3_options(proxy.url))}
    assert states == {"k0": "uncommitted", "k1": "removing", "k2": "uncommitted"}, states
    assert len(seen) - 1 == 3 * 3, seen  # the root's LIST, then 3 per folder


def test_the_stale_sweep_removes_uncommitted_folders_several_at_once_in_few_requests(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hunt66b r4: 15 requests per stale folder, one folder at a time (206 s for 1,000 on moto); the multipart
    # uploads are listed once per root, not once per folder, and the folders go 8 at once, each in its order;
    # so do the interrupted removals (marked folders) a retention finishes
    import threading
    import time

    from smpckpt.catalog import root as catalog_root

    _killed_saves(moto_endpoint, marked=("k1", "k3"), count=5)
    save_checkpoint(f"s3://{BUCKET}/run", "step0", model=_model(0), storage_options=s3_options(moto_endpoint))
    stale, marked = {"k0", "k2", "k4"}, {"k1", "k3"}
    lock, running, most = threading.Lock(), set[str](), {"stale": 0, "marked": 0}
    real = catalog_root.remove_checkpoint

    def counted(url: str, *args: Any, **kwargs: Any) -> bool:
        tag = url.rsplit("/", 1)[-1].removesuffix("_partial")
        with lock:
            running.add(tag)
            most["stale"], most["marked"] = (
                max(most["stale"], len(running & stale)),
                max(most["marked"], len(running & marked)),
            )
        try:
            time.sleep(0.2)  # a real endpoint's latency: lets the removals meet
            return bool(real(url, *args, **kwargs))
        finally:
            with lock:
                running.discard(tag)

    monkeypatch.setattr(catalog_root, "remove_checkpoint", counted)
    seen: list[tuple[str, str, str]] = []

    def record(method: str, path: str, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        seen.append((method, path + "?" + prefix, "uploads" if "uploads" in query else ""))

    with FaultyProxy(moto_endpoint, record) as proxy:  # type: ignore[arg-type]
        opts = s3_options(proxy.url)
        result = catalog_root.apply_retention(
            f"s3://{BUCKET}/run", None, storage_options=opts, uncommitted_older_than=0
        )
        assert result.removed == ("k1", "k3") and result.removed_uncommitted == ("k0", "k2", "k4"), result
        assert result.failed == (), result
        assert _states(f"s3://{BUCKET}/run", opts) == {"step0": "committed"}
        _assert_resumes(f"s3://{BUCKET}/run", opts, "step0", 0)
    assert most == {"stale": 3, "marked": 2}, f"removals in flight at most: {most}"
    assert sum(q == "uploads" for _, _, q in seen) == 1, seen  # the root's, once
    for tag in sorted(stale):
        mine = [(m, p) for m, p, q in seen if f"/{tag}_partial" in p and not q]
        # scan 3 (GET manifest, GET .metadata, LIST), its last activity 1 (LIST), its removal 8: LIST, PUT mark,
        # GET manifest, LIST, DELETE the file, LIST (nothing else?), DELETE mark, GET manifest (not committed since?)
        assert len(mine) == 12, (tag, mine)
        assert [m for m, _ in mine[4:]] == ["GET", "PUT", "GET", "GET", "DELETE", "GET", "DELETE", "GET"], mine


def test_failed_removals_are_named_in_the_pass_order_whatever_their_latency(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # removals run side by side on object stores: a slow one failing after a fast one must still be named in
    # the pass's order (the oldest committed first, then the stale folders), as one by one (rev66d r1)
    import time

    from smpckpt import Location
    from smpckpt.catalog import root as catalog_root

    _killed_saves(moto_endpoint, marked=())  # k0, k1, k2
    root = f"s3://{BUCKET}/run"
    direct = Location(root, storage_options=s3_options(moto_endpoint)).storage_options  # one client for them all
    for step in range(3):
        save_checkpoint(root, f"step{step}", model=_model(step), storage_options=direct)
    delay = {"step0": 0.4, "step1": 0.0, "k0": 0.4, "k1": 0.0}  # the first of each phase answers last
    real = catalog_root.remove_checkpoint

    def slow(url: str, *args: Any, **kwargs: Any) -> bool:
        time.sleep(next((d for t, d in delay.items() if f"/{t}_partial" in url), 0.0))
        return bool(real(url, *args, **kwargs))

    def refuse(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        marking = method == "PUT" and path.endswith("/smpckpt.removing")
        return 403 if marking and any(f"/{t}_partial/" in path for t in delay) else None

    monkeypatch.setattr(catalog_root, "remove_checkpoint", slow)
    with FaultyProxy(moto_endpoint, refuse) as proxy:
        opts = s3_options(proxy.url)
        result = catalog_root.apply_retention(root, 1, storage_options=opts, uncommitted_older_than=0)
    assert result.failed == ("step0", "step1", "k0", "k1"), result
    assert result.removed == () and result.removed_uncommitted == ("k2",), result
    assert _states(root, direct) == {
        **{f"step{s}": "committed" for s in range(3)},
        **{"k0": "uncommitted", "k1": "uncommitted"},
    }
    _assert_resumes(root, direct, "step2", 2)


def test_a_retention_pass_reads_newest_only_to_remove_several_side_by_side(moto_endpoint: str) -> None:
    # rev67b F2: every pass read ``newest`` first (and warned of a damaged one), even one removing nothing;
    # it is read before each removal, and once more only to run several side by side
    from smpckpt.catalog.root import apply_retention

    reset_moto(moto_endpoint, BUCKET)
    opts, root = s3_options(moto_endpoint), f"s3://{BUCKET}/run"
    for step in range(3):
        save_checkpoint(root, f"step{step}", model=_model(step), storage_options=opts)
    seen: list[str] = []
    with FaultyProxy(moto_endpoint, lambda m, p, q: seen.append(m + " " + p) and None) as proxy:  # type: ignore[arg-type]
        for keep, doomed, reads in ((None, (), 0), (3, (), 0), (2, ("step0",), 1), (1, ("step1",), 1)):
            seen.clear()
            result = apply_retention(root, keep, storage_options=s3_options(proxy.url))
            assert result.removed == doomed, (keep, result)
            assert sum(s == f"GET /{BUCKET}/run/newest" for s in seen) == reads, (keep, seen)
    _assert_resumes(root, opts, "step2", 2)


def test_the_stale_sweep_goes_on_past_an_upload_completed_since_it_listed_them(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rev67b F3: the sweep aborts the uploads it listed before removing the stale folders; one completed
    # meanwhile (NoSuchUpload) stopped it: the others stayed open (billed) and none was reported
    import boto3

    from smpckpt.catalog import _debris
    from smpckpt.catalog.root import apply_retention

    _killed_saves(moto_endpoint, marked=(), count=1)
    c = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    keys = [f"run/{t}_partial/b9ec_r0_0.1a22c1fea581bc14902.smp.distcp" for t in ("x", "y", "z")]
    ids = [c.create_multipart_upload(Bucket=BUCKET, Key=k)["UploadId"] for k in keys]
    real = _debris.sweep_debris

    def completing(*args: Any, **kwargs: Any) -> Any:  # another save's slow upload finishes during the sweep
        etag = c.upload_part(Bucket=BUCKET, Key=keys[1], UploadId=ids[1], PartNumber=1, Body=b"x")["ETag"]
        parts = {"Parts": [{"ETag": etag, "PartNumber": 1}]}
        c.complete_multipart_upload(Bucket=BUCKET, Key=keys[1], UploadId=ids[1], MultipartUpload=parts)
        return real(*args, **kwargs)

    monkeypatch.setattr(_debris, "sweep_debris", completing)
    result = apply_retention(
        f"s3://{BUCKET}/run", None, storage_options=s3_options(moto_endpoint), uncommitted_older_than=0
    )
    assert result.aborted_uploads == (f"{BUCKET}/{keys[0]}", f"{BUCKET}/{keys[2]}"), result
    assert c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
