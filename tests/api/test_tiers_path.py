"""The fast tier and ``path``'s state: an emptied ``path`` (a new run must not resume the old run's fast
copies silently) and an unreachable one (an object store's outage: the fast tier goes on)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import s3fs
import tier_workers
import torch
from dist_harness import run_world
from s3_env import FreezingProxy, free_port
from tier_helpers import job as _job
from tier_helpers import linear as _linear
from tier_helpers import same as _same
from tier_helpers import tier_record as _tier_record

from smpckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFound,
    FastTier,
    Location,
    ResumeOptions,
    SaveOptions,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.api._tiers import due_of, durable_key, job_folder


def test_an_emptied_path_refuses_the_old_runs_fast_copies_by_name(tmp_path: Path) -> None:
    """tiers68 F2: ``rm -rf path`` and a new run on the same path and local_path loaded the old run's newest
    fast copy silently (the job folder is keyed by path alone). Its drains are recorded in the job folder:
    path holding none of them is refused, naming both ways on; ``tag=`` loads the fast copy knowingly."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    old = _linear(1)
    for s in (1, 2):
        save_checkpoint(durable, f"s{s}", model=old, options=FastTier(local_path=str(fast), replicas=1))
    wait_for_saves()
    shutil.rmtree(durable)
    opts = [FastTier(local_path=str(fast)), ResumeOptions(missing_ok=True)]
    with pytest.raises(CheckpointNotFound) as got:
        resume_from_checkpoint(durable, model=_linear(9), options=opts)
    said = str(got.value)
    for part in (str(durable), str(_job(fast, durable)), "'s2'", "remove", "tag="):
        assert part in said, (part, said)
    new = _linear(9)
    resume_from_checkpoint(durable, tag="s2", model=new, options=FastTier(local_path=str(fast)))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s2", "fast") and _same(new, old)


def test_a_new_runs_save_of_a_drained_tag_name_is_not_the_drain(tmp_path: Path) -> None:
    """rev68b F1: the record matched tags by name: path emptied, a new run without the fast tier saving 's1'
    (other weights) made resume() load the old run's 's3' from the fast tier silently. Each drain is recorded
    with its save id: refused, naming path and 's3'. A record of tags only (an older version's) matches by
    name, as before."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    for s in (1, 2, 3):
        save_checkpoint(durable, f"s{s}", model=_linear(s), options=FastTier(local_path=str(fast), replicas=1))
    wait_for_saves()
    shutil.rmtree(durable)
    save_checkpoint(durable, "s1", model=_linear(100))
    with pytest.raises(CheckpointNotFound) as got:
        resume_from_checkpoint(durable, model=_linear(9), options=FastTier(local_path=str(fast)))
    for part in (str(durable), "'s3'", "'s1'", "tag="):
        assert part in str(got.value), (part, str(got.value))
    (_job(fast, durable) / "smpckpt.drained.json").write_text('{"drained": ["s3", "s2", "s1"]}')
    new = _linear(9)
    resume_from_checkpoint(durable, model=new, options=FastTier(local_path=str(fast)))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s3", "fast") and _same(new, _linear(3))


def test_the_jobs_own_overwrite_of_a_drained_tag_is_no_emptied_path(tmp_path: Path) -> None:
    """rev68i F3: s2 drained, then replaced in path by the job's own plain save (overwrite=True: another save
    id), s3 saved to the fast tier only: resume() refused as if path had been emptied (naming tag=), path
    holding none of the recorded drains' saves. The job saw path's newest when it saved s3: it is recorded too,
    and s3 resumes bit-exactly (an emptied path or a new run's save is still refused: the tests above)."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    model, tier = _linear(1), FastTier(local_path=str(fast), replicas=1, durable_every=2)
    for s in (1, 2):
        save_checkpoint(durable, f"s{s}", model=model, options=tier)
    wait_for_saves()
    save_checkpoint(durable, "s2", model=_linear(2), options=SaveOptions(overwrite=True))
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(durable, "s3", model=model, options=tier)  # not due: the fast tier only
    wait_for_saves()
    got = _linear(9)
    resume_from_checkpoint(durable, model=got, options=FastTier(local_path=str(fast)))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s3", "fast") and _same(got, model)


def test_a_tiered_save_reads_paths_newest_once(tmp_path: Path, monkeypatch: Any) -> None:
    """rev69e L4: F3's record of path's newest read ``newest`` and its manifest once more per tiered save (on S3,
    a save not due made 8 requests instead of 6); it now records what the save's numbering read: one read of
    ``newest`` per save (the first save of a Checkpointer lists the root instead), and the guarantee holds
    (the test above)."""
    import smpckpt.catalog.root as root_module

    reads: list[str] = []
    real = root_module.read_newest

    def counted(fs: Any, root_path: str, said: Any = None) -> Any:
        reads.append(root_path)
        return real(fs, root_path, said)

    monkeypatch.setattr(root_module, "read_newest", counted)
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    tier = FastTier(local_path=str(fast), replicas=1, durable_every=2)
    ckpt = Checkpointer(durable, fast_tier=tier)
    per_save = []
    for s in (1, 2, 3):
        reads.clear()
        ckpt.save(f"s{s}", model=_linear(s))
        ckpt.wait()
        per_save.append(len(reads))
    assert per_save[1:] == [1, 1], per_save


def test_a_restart_with_path_intact_or_never_drained_resumes_the_fast_tier(tmp_path: Path) -> None:
    """Not the emptied case: path holds the recorded drain (s2; s3 newer, in the fast tier only), or no drain
    was due yet (durable_every=5: path empty, nothing recorded)."""
    durable, fast, fresh = tmp_path / "durable", tmp_path / "fast", tmp_path / "fresh"
    m3 = _linear(3)
    for s in (1, 2, 3):
        save_checkpoint(
            durable,
            f"s{s}",
            model=_linear(s) if s < 3 else m3,
            options=FastTier(local_path=str(fast), replicas=1, durable_every=2),
        )
    save_checkpoint(
        tmp_path / "other", "a1", model=m3, options=FastTier(local_path=str(fresh), replicas=1, durable_every=5)
    )
    wait_for_saves()
    for root, local in ((durable, fast), (tmp_path / "other", fresh)):
        got = _linear(9)
        resume_from_checkpoint(root, model=got, options=FastTier(local_path=str(local)))
        info = last_resume_info()
        assert info is not None and info.tier == "fast" and _same(got, m3)


def _resumes_from_path(
    root: str, options: dict[str, Any], tmp_path: Path, tag: str, want: Any, got: Any = None
) -> None:
    """A resume from ``path`` alone (an empty fast tier) into ``got`` (default: a small linear) loads ``tag``,
    bit-exactly ``want``'s state."""
    got = _linear(9) if got is None else got
    resume_from_checkpoint(
        Location(root, storage_options=options), model=got, options=FastTier(local_path=str(tmp_path / "empty"))
    )
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == (tag, "durable") and _same(got, want)


def _down(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` pointing at a port nobody listens on, one attempt each: the same root, unreachable (the
    job folder's key is the root without its endpoint)."""
    cfg = {**options["config_kwargs"], "retries": {"max_attempts": 1, "mode": "standard"}}
    client = {**options["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    return {**options, "client_kwargs": client, "config_kwargs": cfg}


def test_while_path_is_unreachable_saves_go_to_the_fast_tier(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """tiers68 F3: with path's endpoint down, a save not due for path failed on its probe of path, and a
    resume on path's listing even with tag=. Now the save goes on (warned, naming path), resume(tag=)
    loads the fast copy (warned), resume() refuses naming the fast tier's newest (path may hold newer)."""
    root, options = s3_root
    fast, down = str(tmp_path / "fast"), _down(options)
    assert durable_key(root, down) == durable_key(root, options)
    m1, m3 = _linear(1), _linear(3)
    for tag in ("s1", "s2"):
        save_checkpoint(
            Location(root, storage_options=options),
            tag,
            model=m1,
            options=FastTier(local_path=fast, replicas=1, durable_every=2),
        )
    wait_for_saves()
    with pytest.warns(UserWarning, match=f"{root}.*unreachable.*Connect"):
        save_checkpoint(
            Location(root, storage_options=down),
            "s3",
            model=m3,
            options=FastTier(local_path=fast, replicas=1, durable_every=2),
        )
    with pytest.raises(CheckpointError, match=f"{root}.*unreachable.*Connect.*'s3'.*tag="):
        resume_from_checkpoint(
            Location(root, storage_options=down), model=_linear(9), options=FastTier(local_path=fast)
        )
    got = _linear(9)
    with pytest.warns(UserWarning, match=f"{root}.*unreachable"):
        resume_from_checkpoint(
            Location(root, storage_options=down), tag="s3", model=got, options=FastTier(local_path=fast)
        )
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s3", "fast") and _same(got, m3)
    # path back: the next due save drains, numbered after s3
    save_checkpoint(
        Location(root, storage_options=options),
        "s4",
        model=m3,
        options=FastTier(local_path=fast, replicas=1, durable_every=2),
    )
    wait_for_saves()
    _resumes_from_path(root, options, tmp_path, "s4", m3)


def test_a_hung_path_stalls_no_save_and_the_due_save_drains_once_it_answers(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """rev68b F2, F3: with path's endpoint hung (connections accepted, never answered) a due save's drain
    started anyway, its copiers blocking for retries x timeouts and the next save waiting for them (minutes
    at 1 s timeouts); each save also read path's ``newest`` again, paying its timeouts. Now while path does
    not answer the due save is kept pending, not drained, and ``newest`` is not read; path back, the next
    save drains it and path's resume is bit-exact."""
    root, options = s3_root
    hole, asked = socket.socket(), []
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)

    def accept() -> None:  # the requests' first lines: what each save asked of the hung path
        with contextlib.suppress(OSError):
            while True:
                conn, _ = hole.accept()
                asked.append(conn.recv(4096).split(b"\r\n")[0].decode())

    threading.Thread(target=accept, daemon=True).start()
    cfg = {"connect_timeout": 0.2, "read_timeout": 0.2, "retries": {"max_attempts": 1, "mode": "standard"}}
    client = {**options["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{hole.getsockname()[1]}"}
    hung = {**options, "client_kwargs": client, "config_kwargs": cfg}
    fast, models = str(tmp_path / "fast"), {s: _linear(s) for s in range(1, 6)}

    def save(s: int, opts: dict[str, Any]) -> float:
        began = time.monotonic()
        save_checkpoint(
            Location(root, storage_options=opts),
            f"s{s}",
            model=models[s],
            options=FastTier(local_path=fast, replicas=1, durable_every=2),
        )
        return time.monotonic() - began

    save(1, options), save(2, options)
    wait_for_saves()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            took = [save(3, hung), save(4, hung)]  # s4 due: pending
            began = time.monotonic()
            wait_for_saves()  # no drain in flight
            took.append(time.monotonic() - began)
    finally:
        hole.close()
    assert max(took) < 20, (took, asked)
    assert not [a for a in asked if "newest" in a or not a.startswith("GET")], asked
    save(5, options)  # path back: s5 (not due) drains s4
    wait_for_saves()
    got = _linear(9)
    resume_from_checkpoint(
        Location(root, storage_options=options), model=got, options=FastTier(local_path=str(tmp_path / "e"))
    )
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s4", "durable") and _same(got, models[4])


def test_a_save_past_the_outage_never_drains_over_a_committed_tag(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The tag check skipped while path was down happens at the drain: a tag path holds committed (another
    writer's) is never drained over; path's copy stays as it was."""
    root, options = s3_root
    fast, down = str(tmp_path / "fast"), _down(options)
    save_checkpoint(Location(root, storage_options=options), "x", model=_linear(1))  # without the fast tier
    fs = s3fs.S3FileSystem(**options)
    key = f"{root[len('s3://') :]}/x_partial/smpckpt.manifest.json"
    before = fs.cat(key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_checkpoint(
            Location(root, storage_options=down), "x", model=_linear(2), options=FastTier(local_path=fast, replicas=1)
        )
        wait_for_saves()  # x, due, is not drained while path is down (rev68b F2): pending
        with pytest.warns(UserWarning, match="'x'.*cannot be drained.*x_partial holds another checkpoint"):
            save_checkpoint(
                Location(root, storage_options=options),
                "y",
                model=_linear(3),
                options=FastTier(local_path=fast, replicas=1, durable_every=3),
            )
        wait_for_saves()
    s3fs.S3FileSystem.clear_instance_cache()
    assert s3fs.S3FileSystem(**options).cat(key) == before
    assert (Path(job_folder(fast, durable_key(root, options))) / "x_partial").is_dir()


def test_every_rank_gets_the_same_answer_on_two_nodes(s3_root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """4 ranks on 2 nodes (replicas=2): the emptied path refused on every rank by the same text; with path
    unreachable the save goes on, resume() refuses and resume(tag=) loads, alike on every rank, no hang.
    hunt72b: node 0 back with its old disk, whose record names only a drain path's retention removed since,
    was refused as an emptied path (node 0's record alone decided) though path holds c4, a drain node 1's
    record names: every node's record counts. rev72b: a record of tags only (an older version's) on node 1
    matched a new run's c4 by name (M1); node 0 replaced by a fresh machine was refused, the drain record
    of path's newest (seen, not drained) written on node 0 alone (H1). rev72e LOW-3: so was the record of
    path's checkpoint a resume loaded (every node's first rank records it now; no test held that)."""
    root, options = s3_root
    got = run_world(
        tier_workers.path_cases, 4, str(tmp_path / "fast"), str(tmp_path / "durable"), root, options, _down(options)
    )
    for key in ("emptied", "resume_down"):  # rank 0 decides, every rank raises its text
        said = [(r[key][0], r[key][1].replace("rank 0 failed: ", "")) for r in got]
        assert all(s == said[0] for s in said), said
    for r in got:
        assert r["emptied"][0] == "error" and "CheckpointNotFound" in r["emptied"][1] and "'a2'" in r["emptied"][1]
        assert r["save_down"][0] == "ok" and r["tag_down"][0] == "ok" and r["exact"]
        assert r["resume_down"][0] == "error" and "'b2'" in r["resume_down"][1] and root in r["resume_down"][1]
    assert got[0]["save_down"][1] and got[0]["tag_down"][1]  # warned on rank 0, naming path
    for rank, r in enumerate(got):  # node 0 back with its old disk: its drain record (c2, gone) is stale
        old = r["old_disk"]["old_disk"]
        assert isinstance(old, dict), (rank, old)
        assert (old["tag"], old["tier"], old["exact"], old["path"]) == ("c4", "fast", True, ["c4_partial", "newest"])
        # rev72b M1: node 1's older (tags-only) record does not match a new run's c4 by name
        said = r["old_disk"]["tags_only_new_run"]
        assert isinstance(said, str), (rank, said)
        said = said.replace("rank 0 failed: ", "")
        assert said == got[0]["old_disk"]["tags_only_new_run"] and said.startswith("CheckpointNotFound: path "), (
            rank,
            said,
        )
        assert "holds none of the saves this fast tier's job drained there (tags 'c2'; " in said, (rank, said)
        fresh = r["fresh_node0"]
        # rev72b L1: the drain records ride in the listings' gather: a tag-less resume gathers no more than tag=
        assert fresh["gathers"]["tagless"] == fresh["gathers"]["tag"], (rank, fresh["gathers"])
        # rev72b H1: node 0 replaced (empty local_path); w6, seen by t7's draw, is known to node 1's record
        assert fresh["path"] == ["newest", "w6_partial"], (rank, fresh)
        assert isinstance(fresh["got"], dict), (rank, fresh)
        assert (fresh["got"]["tag"], fresh["got"]["tier"], fresh["got"]["exact"]) == ("t7", "fast", True), (rank, fresh)
        # rev72e LOW-3: path's w2, which the job resumed, is known to node 1's record too (node 0 replaced)
        resumed = r["fresh_node0_resumed"]
        assert isinstance(resumed, dict), (rank, resumed)
        assert (resumed["tag"], resumed["tier"], resumed["exact"]) == ("x3", "fast", True), (rank, resumed)


def test_a_due_save_pending_while_path_is_down_outlives_fast_tier_retention_and_drains(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """rev68i F1: durable_every=4, two copies kept: s4 (due) saved while path was down stayed pending, fast-tier
    retention removed it at s6 (path still down) and s7, path back, drained nothing: path stayed empty, and
    nothing said so. The newest due save is kept until it drains."""
    root, options = s3_root
    fast, down = str(tmp_path / "fast"), _down(options)
    m4 = _linear(4)
    for i, up in enumerate("uuudddu", 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # path unreachable: said, tested above
            save_checkpoint(
                Location(root, storage_options=options if up == "u" else down),
                f"s{i}",
                model=m4 if i == 4 else _linear(i),
                options=FastTier(local_path=fast, replicas=1, durable_every=4, num_kept_local=2),
            )
    wait_for_saves()
    _resumes_from_path(root, options, tmp_path, "s4", m4)


def test_a_job_restarted_and_saving_through_an_outage_resumes_its_save_after_it(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """rev68i F4: s1 drained; the job restarted (resume(): a Checkpointer without the save's FastTier options,
    replaced by the save's), saved s2 while path was down, and stopped: the next restart, path back, refused
    s2 as "diverged histories" (s2 recorded path_seen 0: the save's Checkpointer took over the save numbers but
    not what the resume saw in path). Now it resumes s2 bit-exactly."""
    root, options = s3_root
    proxy = FreezingProxy(int(options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1]))
    cfg = {**options["config_kwargs"], "retries": {"max_attempts": 1, "mode": "standard"}}
    client = {**options["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{proxy.port}"}
    loc = Location(root, storage_options={**options, "client_kwargs": client, "config_kwargs": cfg})
    fast, tier = str(tmp_path / "fast"), FastTier(local_path=str(tmp_path / "fast"), replicas=1, num_kept_local=1)
    try:
        save_checkpoint(loc, "s1", model=_linear(1), options=tier)
        wait_for_saves()
        model = _linear(9)  # the restarted job
        resume_from_checkpoint(loc, model=model, options=FastTier(local_path=fast))
        proxy.down = True
        with torch.no_grad():
            model.weight.add_(1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # path unreachable: said, tested above
            save_checkpoint(loc, "s2", model=model, options=tier)
        wait_for_saves()  # s2, due, pending: no drain while path is down
        proxy.down = False
        got = _linear(7)  # the job restarted again, path back
        resume_from_checkpoint(loc, model=got, options=FastTier(local_path=fast))
    finally:
        proxy.close()
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s2", "fast") and _same(got, model)


def test_a_restart_resuming_by_tag_while_path_is_down_knows_what_its_copy_knew_in_path(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """fix70d 3: s1 saved and drained; the job restarted with path down and resumed s1 by tag from the fast tier
    (path not seen: it knew nothing there, 0), saved s2 through the outage (s2 recorded path_seen 0, though the
    job folder's s1 is in path) and stopped; the next restart, path back, tag-less, refused s2 as "diverged
    histories" from path's newest, s1 (no longer in the fast tier: one copy kept). Now the resume takes over what
    its copy's job knew in path (s1 itself, due there), and the restart resumes s2 bit-exactly."""
    root, options = s3_root
    fast, down = str(tmp_path / "fast"), _down(options)
    tier = FastTier(local_path=fast, replicas=1, num_kept_local=1)
    save_checkpoint(Location(root, storage_options=options), "s1", model=_linear(1), options=tier)
    wait_for_saves()
    model = _linear(9)  # the restarted job, path down: by tag, from the fast tier
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # path unreachable: said, tested above
        resume_from_checkpoint(
            Location(root, storage_options=down), "s1", model=model, options=FastTier(local_path=fast)
        )
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(Location(root, storage_options=down), "s2", model=model, options=tier)
    wait_for_saves()  # s2, due, pending: no drain while path is down
    assert _tier_record(_job(Path(fast), root) / "s2_partial")["path_seen"] == 1  # s1's number (was 0)
    got = _linear(7)  # the job restarted again, path back
    resume_from_checkpoint(Location(root, storage_options=options), model=got, options=FastTier(local_path=fast))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s2", "fast") and _same(got, model)


def _s1_drained_s2_due(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> tuple[str, Location, Location, str, FastTier]:
    """s1 saved and drained to path; s2 saved while path is down: due there, never drained. (root, path up, path
    down, the fast folder, the tier)."""
    root, options = s3_root
    up, down = Location(root, storage_options=options), Location(root, storage_options=_down(options))
    fast = str(tmp_path / "fast")
    tier = FastTier(local_path=fast, replicas=1, num_kept_local=1)
    save_checkpoint(up, "s1", model=_linear(1), options=tier)
    wait_for_saves()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # path unreachable: said, tested above
        save_checkpoint(down, "s2", model=_linear(2), options=tier)
    wait_for_saves()
    return root, up, down, fast, tier


def test_a_copy_only_due_in_path_is_not_known_there_after_a_resume_by_tag(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """rev70d: job J saved s1 (drained) and s2 (due, never drained: path down) and died; job X resumed s1 from
    path and saved x2, at s2's number. J restarted, resumed s2 by tag from the fast tier and saved s3 through
    another outage: the resume took s2's number as known in path, so s3 recorded path_seen 2 and the next
    tag-less restart loaded s3 over x2 silently. A copy only due is not known there: the histories are refused."""
    root, up, down, fast, tier = _s1_drained_s2_due(s3_root, tmp_path)
    other = _linear(0)  # job X, without the fast tier
    resume_from_checkpoint(up, model=other)
    assert last_resume_info().tag == "s1"  # type: ignore[union-attr]
    save_checkpoint(up, "x2", model=other)
    model = _linear(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resume_from_checkpoint(down, "s2", model=model, options=FastTier(local_path=fast))
        save_checkpoint(down, "s3", model=model, options=tier)
    wait_for_saves()
    assert _tier_record(_job(Path(fast), root) / "s3_partial")["path_seen"] < 2  # s2 was never in path
    with pytest.raises(CheckpointError, match="diverged"):
        resume_from_checkpoint(up, model=_linear(7), options=FastTier(local_path=fast))


@contextlib.contextmanager
def _proxied(options: dict[str, Any]) -> Any:
    """``path`` through a :class:`FreezingProxy` (``down``: an outage), one attempt per request."""
    proxy = FreezingProxy(int(options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1]))
    cfg = {**options["config_kwargs"], "retries": {"max_attempts": 1, "mode": "standard"}}
    client = {**options["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{proxy.port}"}
    try:
        yield proxy, {**options, "client_kwargs": client, "config_kwargs": cfg}
    finally:
        proxy.close()


@pytest.mark.parametrize("every", [1, 2])
def test_a_save_only_due_in_path_is_not_another_writers_save_of_its_number(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path, every: int
) -> None:
    """rev70d (fix70f): one Checkpointer saved up to s{d} drained, then its next saves while path was down (due,
    never drained) and died; job X (no fast tier) resumed s{d} from path and saved x, numbered d + 1. The job's
    later saves had recorded the due numbers as known in path (path_seen), so the tag-less restart loaded the
    fast tier's newest over x silently (every=2: x's number is no due save's, below a due one). Now a due number
    is known only as that save (``due``: number, save id): the restart refuses, naming both."""
    root, options = s3_root
    fast = str(tmp_path / "fast")
    tier = FastTier(local_path=fast, replicas=1, num_kept_local=1, durable_every=every)
    with _proxied(options) as (proxy, flaky):
        c = Checkpointer(Location(root, storage_options=flaky), fast_tier=tier)
        for s in range(1, every + 1):  # s{every} drained
            c.save(f"s{s}", model=_linear(s))
            c.wait()
        proxy.down, ids = True, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # path unreachable: said, tested above
            for s in range(every + 1, 2 * every + 2):  # every=1: s2, s3 (both due); every=2: s3, s4 (due), s5
                c.save(f"s{s}", model=_linear(s))
                c.wait()
                ids[s] = json.loads((_job(Path(fast), root) / f"s{s}_partial" / "smpckpt.manifest.json").read_text())
        proxy.down = False
        newest = f"s{2 * every + 1}"
        other = _linear(0)  # job X, without the fast tier
        resume_from_checkpoint(Location(root, storage_options=options), model=other)
        assert last_resume_info().tag == f"s{every}"  # type: ignore[union-attr]
        save_checkpoint(Location(root, storage_options=options), "x", model=other)
        with pytest.raises(CheckpointError, match=rf"diverged.*'{newest}'.*'x'|diverged.*'x'.*'{newest}'"):
            resume_from_checkpoint(
                Location(root, storage_options=flaky), model=_linear(7), options=FastTier(local_path=fast)
            )
        got = _linear(7)  # tag= chooses: the fast tier's history
        resume_from_checkpoint(
            Location(root, storage_options=flaky), newest, model=got, options=FastTier(local_path=fast)
        )
        assert last_resume_info().tier == "fast" and _same(got, _linear(2 * every + 1))  # type: ignore[union-attr]
        # what it recorded: path_seen what it read in path (s{every}), its due save with the save's id
        record = _tier_record(_job(Path(fast), root) / f"{newest}_partial")
        assert (record["path_seen"], record["due"]) == (every, [[2 * every, ids[2 * every]["save_id"]]])


def test_a_due_save_drained_later_is_known_as_paths_newest(s3_root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """fix70f: s2, due while path was down, drained by s3's save once path answered (a retry), and the fast tier
    let s2 go: path's newest, at s2's number above s3's path_seen, is s3's due save (its save id): s3 loads."""
    root, options = s3_root
    fast = str(tmp_path / "fast")
    tier = FastTier(local_path=fast, replicas=1, num_kept_local=1, durable_every=2)
    with _proxied(options) as (proxy, flaky):
        c = Checkpointer(Location(root, storage_options=flaky), fast_tier=tier)
        c.save("s1", model=_linear(1))
        c.wait()
        proxy.down = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # path unreachable: said, tested above
            c.save("s2", model=_linear(2))
            c.wait()
        proxy.down = False
        model = _linear(3)
        c.save("s3", model=model)  # not due: drains s2 again
        c.wait()
        c.close()
        job = _job(Path(fast), root)
        shutil.rmtree(job / "s2_partial", ignore_errors=True)  # gone from the fast tier (retention's to decide)
        record = _tier_record(job / "s3_partial")
        assert record["path_seen"] < 2 and [n for n, _ in record["due"]] == [2]
        assert s3fs.S3FileSystem(**options).exists(f"{root}/s2_partial/smpckpt.manifest.json")
        got = _linear(7)
        resume_from_checkpoint(Location(root, storage_options=options), model=got, options=FastTier(local_path=fast))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s3", "fast") and _same(got, model)


def test_a_record_without_due_keeps_the_older_meaning_and_a_damaged_one_knows_less() -> None:
    """fix70f: ``extra["tier"]["due"]`` absent (an older copy): ``None``, its ``path_seen`` compared alone, as
    before; a damaged entry is no save of the job's (fewer known in path: a refusal, never a wrong load)."""
    assert due_of(None) is None
    assert due_of([[2, "a"], ["3", "b"], [4], [5, 6], True]) == ((2, "a"),)
    assert due_of("junk") == ()


@pytest.mark.parametrize("writer", ["another job", "a plain save of the tag"])
def test_a_due_save_and_another_writers_save_of_its_number_are_refused_whichever_is_later(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Path, writer: str
) -> None:
    """fix70g: s1 drained, s2 due and never drained (path down); then a writer numbering from path alone saved
    at s2's number 2, later by the clock: job X (no fast tier) resuming s1 and saving x2, or a plain
    save_checkpoint of the tag s2 itself (its own Checkpointer). Equal numbers went to the later save time: the
    tag-less restart loaded path's silently and dropped s2 (s2 later: refused as diverged). Refused alike now,
    naming both; tag= chooses (the same tag in both tiers: tag= loads path's, the later save of it)."""
    root, up, down, fast, tier = _s1_drained_s2_due(s3_root, tmp_path)
    if writer == "another job":
        other = _linear(0)
        resume_from_checkpoint(up, model=other)
        assert last_resume_info().tag == "s1"  # type: ignore[union-attr]
        theirs, saved = "x2", other
        save_checkpoint(up, theirs, model=other)
    else:
        theirs, saved = "s2", _linear(5)
        save_checkpoint(up, theirs, model=saved)  # numbered from path alone: 2, as s2
    said = rf"'s2' \(sequence number 2\).*tag '{theirs}', sequence number 2\), belong to diverged"
    said += ".*Both are tag 's2'" if theirs == "s2" else ".*tag='x2'.*tag='s2'"
    with pytest.raises(CheckpointError, match=said):
        resume_from_checkpoint(up, model=_linear(7), options=FastTier(local_path=fast))
    got = _linear(7)  # path's, by its tag
    resume_from_checkpoint(up, theirs, model=got, options=FastTier(local_path=fast))
    assert last_resume_info().tier == "durable" and _same(got, saved)  # type: ignore[union-attr]
    if theirs != "s2":  # the fast tier's, by its tag
        resume_from_checkpoint(up, "s2", model=got, options=FastTier(local_path=fast))
        assert last_resume_info().tier == "fast" and _same(got, _linear(2))  # type: ignore[union-attr]
