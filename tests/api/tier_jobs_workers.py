"""Rank functions for issue 46's tiered-checkpoint cases (tests/api/test_tiers_ranks.py): several jobs sharing
each node's ``local_path``, crafted and corrupt fast-tier folders, folders refused up front, a drain
killed and retried. 2 simulated nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``), as in ``tier_workers``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import tp_model
from tier_workers import LAYOUT, _clone, _info, _same, _save, job_dir, node_dir, partials

from smpckpt import CheckpointExists, FastTier, Sharding, resume_from_checkpoint, save_checkpoint, wait_for_saves

MANIFEST = "smpckpt.manifest.json"


def _attempt(fn: Callable[[], Any]) -> str:
    """``ok <result>`` or the error's type and message (the tests compare them across ranks)."""
    try:
        return f"ok {fn()!r}"
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}"


def _resume(durable: str, local: str, seed: int, **kw: Any) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """Resume into a fresh model; its user_content, this rank's state, and the warnings it raised."""
    ctx, model, opt = tp_model.build(LAYOUT, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        uc = resume_from_checkpoint(
            durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local, **kw
        )
    return uc, tp_model.local_state(model, opt), [str(w.message) for w in caught]


def _states(base: str, rank: int, steps: range | tuple[int, ...], durable: str, local: str, **kw: Any) -> None:
    """Train and save ``steps``, leaving each state in ``base`` (``state{step}_rank{rank}.pt``)."""
    ctx, model, opt = tp_model.build(LAYOUT)
    for step in steps:
        tp_model.train_step(ctx, model, opt, step)
        torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
        _save(durable, local, step, model, opt, **kw)
    wait_for_saves()
    dist.barrier()  # a node's first rank may still be applying num_kept_local


def _want(base: str, step: int, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(base, f"state{step}_rank{rank}.pt"))


def craft(folder: str, tag: str, source: str, change: Callable[[dict[str, Any]], None]) -> None:
    """``{folder}/{tag}_partial`` with ``source``'s manifest changed by ``change`` and its digest
    recomputed (a crafted folder that passes the manifest's own checksum), and no data files."""
    from smpckpt.storage.format.manifest import _DIGEST_KEY, _self_digest

    with open(os.path.join(source, MANIFEST)) as f:
        obj = json.load(f)
    obj.pop(_DIGEST_KEY)
    obj["extra"]["tag"] = tag
    change(obj)
    obj[_DIGEST_KEY] = f"{_self_digest(obj):016x}"
    os.makedirs(os.path.join(folder, f"{tag}_partial"))
    with open(os.path.join(folder, f"{tag}_partial", MANIFEST), "w") as f:
        json.dump(obj, f)


# -- 1 and 6: jobs apart -------------------------------------------------------------------------------
def jobs_apart(rank: int, world: int, base: str) -> dict[str, Any]:
    """Job X saves step1-2 (fast tier only); a new job Z with an empty path resumes (missing_ok) and
    saves step1; job Y saves step101-103 with num_kept_local=2; a link to Y's step103 is put in X's job
    folder as step9; then X resumes. All share each node's local_path."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(os.path.join(base, "fast"), rank)
    dx, dy, dz = (os.path.join(base, name) for name in ("X", "Y", "Z"))
    out: dict[str, Any] = {}
    _states(base, rank, (1, 2), dx, local, durable_every=100)
    ctx, zmodel, zopt = tp_model.build(LAYOUT, seed=7)
    out["z_resume"] = _attempt(
        lambda: resume_from_checkpoint(
            dz, model=zmodel, optimizer=zopt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local, missing_ok=True
        )
    )
    out["z_save"] = _attempt(lambda: _save(dz, local, 1, zmodel, zopt, durable_every=100))
    ctx, ymodel, yopt = tp_model.build(LAYOUT, seed=8)
    for step in (101, 102, 103):
        tp_model.train_step(ctx, ymodel, yopt, step)
        _save(dy, local, step, ymodel, yopt, durable_every=100, num_kept_local=2)
    wait_for_saves()
    dist.barrier()
    if rank % 2 == 0:  # another job's checkpoint linked into X's folder under a newer-looking tag
        os.symlink(
            os.path.join(job_dir(local, dy), "step103_partial"), os.path.join(job_dir(local, dx), "step9_partial")
        )
    dist.barrier()
    out["jobs"] = {name: partials(job_dir(local, d)) for name, d in (("X", dx), ("Y", dy), ("Z", dz))}
    uc, state, said = _resume(dx, local, 9)
    out["x_resume"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, 2, rank)), "warnings": said}
    return out


def slot_of_incomplete(rank: int, world: int, base: str) -> dict[str, Any]:
    """num_kept_local=2: step1, step2 saved; a crafted newer save 'zz' (this job's root, seq 9, its data
    files nowhere) put in node 0's job folder; step3 saved: retention keeps step2 and step3."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    _states(base, rank, (1, 2), durable, local, durable_every=100)
    if rank == 0:
        job = job_dir(local, durable)
        craft(job, "zz", os.path.join(job, "step2_partial"), lambda m: m["extra"]["tier"].update(seq=9))
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=3)
    _save(durable, local, 3, model, opt, durable_every=100)
    wait_for_saves()
    dist.barrier()
    return {"after": partials(job_dir(local, durable))}


# -- 3: crafted, unsafe folders --------------------------------------------------------------------------
def _climb(m: dict[str, Any]) -> None:
    m["files"][0]["name"] = "../x"


def _absolute(m: dict[str, Any]) -> None:
    m["files"][0]["name"] = "/etc/x"


def _metadata_climbs(m: dict[str, Any]) -> None:
    m["metadata"]["name"] = "../.metadata.x"


def unsafe_folders(rank: int, world: int, base: str) -> dict[str, Any]:
    """step1, step2 saved; rank 0 crafts in node 0's job folder three folders whose manifests (digest
    recomputed) name ``../x``, ``/etc/x`` and a ``../`` metadata name -- one with a newer save number --
    and rank 2 one more in node 1's; every rank resumes, then saves step3."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    _states(base, rank, (1, 2), durable, local, durable_every=100)
    job = job_dir(local, durable)
    step1 = os.path.join(job, "step1_partial")
    if rank == 0:
        craft(job, "junk_climb", step1, _climb)
        craft(job, "junk_abs", step1, _absolute)
        craft(job, "junk_meta", step1, lambda m: (_metadata_climbs(m), m["extra"]["tier"].update(seq=50)))
    if rank == 2:
        craft(job, "junk_node1", step1, _climb)
    dist.barrier()
    uc, state, said = _resume(durable, local, 5)
    out: dict[str, Any] = {**_info(), "uc": uc, "exact": _same(state, _want(base, 2, rank))}
    out["warnings"] = sorted(w for w in said if "unsafe" in w)
    ctx, model, opt = tp_model.build(LAYOUT, seed=6)
    out["save3"] = _attempt(lambda: _save(durable, local, 3, model, opt, durable_every=100))
    wait_for_saves()
    dist.barrier()
    out["after"] = partials(job)
    return out


# -- 4: replicas that heal ------------------------------------------------------------------------------
def _flip(path: str, at: int | None = None) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def heal_from_peers(rank: int, world: int, base: str) -> dict[str, Any]:
    """step1-3 saved with replicas=2 (nothing durable). (a) One byte flipped in node 0's copy of a file
    rank 0 wrote for step3: resume loads step3, the file fetched from node 1's intact copy. (b) The same
    byte flipped in both nodes' copies: resume loads step2. (c) Node 0's copy of a step2 file removed,
    for ``smpckpt verify --local`` (the test runs it). (d) A byte of node 0's step1 metadata flipped: resume
    of step1 loads it from the fast tier, node 0's metadata fetched from node 1."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    _states(base, rank, (1, 2, 3), durable, local, durable_every=100, num_kept_local=None)
    job = job_dir(local, durable)
    from smpckpt.storage import Manifest

    with open(os.path.join(job, "step3_partial", MANIFEST), "rb") as f:
        victim = min(r.name for r in Manifest.from_bytes(f.read()).files if r.rank == 0)
    node0, node1 = (job_dir(node_dir(os.path.join(base, "fast"), r), durable) for r in (0, 2))
    if rank == 0:
        _flip(os.path.join(node0, "step3_partial", victim))
    dist.barrier()
    out: dict[str, Any] = {"victim": victim}
    uc, state, said = _resume(durable, local, 11)
    out["one_copy"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, 3, rank)), "warnings": said}
    dist.barrier()
    good = open(os.path.join(node1, "step3_partial", victim), "rb").read()
    out["healed"] = open(os.path.join(node0, "step3_partial", victim), "rb").read() == good
    dist.barrier()
    if rank == 0:
        for node in (node0, node1):
            _flip(os.path.join(node, "step3_partial", victim))
    dist.barrier()
    uc, state, said = _resume(durable, local, 12)
    out["both_copies"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, 2, rank)), "warnings": said}
    dist.barrier()
    if rank == 0:
        with open(os.path.join(node0, "step2_partial", MANIFEST), "rb") as f:
            victim2 = min(r.name for r in Manifest.from_bytes(f.read()).files if r.rank == 0)
        os.unlink(os.path.join(node0, "step2_partial", victim2))
        out["removed"] = victim2
    if rank == 0:  # (d) node 0's step1 metadata damaged, its size kept: the retried load fetches node 1's
        _flip(os.path.join(node0, "step1_partial", _metadata_name(os.path.join(node0, "step1_partial"))))
    dist.barrier()
    uc, state, said = _resume(durable, local, 13, tag="step1")
    out["metadata"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, 1, rank)), "warnings": said}
    return out


def stale_node_after_tag_reuse(rank: int, world: int, base: str) -> dict[str, Any]:
    """step1 saved with replicas=1; node 1 lost (its folder emptied, a snapshot kept), so step1 is
    incomplete and saved again (other values, replicas=2: node 0 alone holds it whole). Node 1 comes back
    with its stale disk: its folder holds the OLDER step1's manifest. The newer step1 must still load,
    node 1 healing in its manifest (the older one refused it: files are created, never written over).
    Then node 1's (healed) manifest is damaged: step1 must load again, healed in once more; then a data
    file and the metadata cut short on node 1 (sizes no longer the manifest's): fetched again."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    _states(base, rank, (1,), durable, local, replicas=1, durable_every=100)
    snap = os.path.join(base, "node1-snapshot")
    if rank == 2:
        shutil.copytree(local, snap, symlinks=True)
        shutil.rmtree(local)
        os.makedirs(local)
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT)
    for step in (1, 2):
        tp_model.train_step(ctx, model, opt, step)
    want = _clone(tp_model.local_state(model, opt))
    save_checkpoint(
        durable,
        "step1",
        model=model,
        optimizer=opt,
        user_content={"step": 12},
        layout=LAYOUT,
        specs=tp_model.SPECS,
        local_path=local,
        replicas=2,
        durable_every=100,
    )
    wait_for_saves()
    dist.barrier()
    if rank == 2:
        shutil.rmtree(local)
        shutil.copytree(snap, local, symlinks=True)  # the node is back, with its old disk
    dist.barrier()
    out: dict[str, Any] = {}

    def resumed(seed: int, tag: str | None = None) -> Any:
        """What a resume loaded (bit-exact against ``want`` or not), or its error."""
        try:
            uc, state, _ = _resume(durable, local, seed, tag=tag)
            return {**_info(), "uc": uc, "exact": _same(state, want)}
        except Exception as exc:  # noqa: BLE001 - the error is what the test shows
            return f"{type(exc).__name__}: {exc}"

    for tag in (None, "step1"):
        out[str(tag)] = resumed(13, tag)
        dist.barrier()
    if rank == 2:  # node 1's manifest (healed in above) damaged: node 0's is intact, every part on node 0
        _flip(os.path.join(job_dir(local, durable), "step1_partial", MANIFEST))
    dist.barrier()
    out["damaged"] = resumed(14)
    dist.barrier()
    if rank == 2:  # one of rank 2's files, and the metadata, cut short on node 1 (node 0's intact)
        folder = os.path.join(job_dir(local, durable), "step1_partial")
        for name in (sorted(n for n in os.listdir(folder) if "_r2_" in n)[0], _metadata_name(folder)):
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(folder, name)) // 2)
    dist.barrier()
    out["cut_short"] = resumed(15)
    return out


def _metadata_name(folder: str) -> str:
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        return str(json.loads(f.read())["metadata"]["name"])


# -- 5: folders refused up front --------------------------------------------------------------------------
def refused_folders(rank: int, world: int, base: str) -> dict[str, Any]:
    """Both nodes on one folder; local_path equal to path, inside it, containing it; a file; a folder
    that cannot be written (``/sys``, when it cannot). Every rank's error, and what was left."""
    from torch import nn

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    durable = os.path.join(base, "durable")
    if rank == 0:
        os.makedirs(durable)
        open(os.path.join(base, "file"), "wb").close()
    dist.barrier()
    model = nn.Linear(4, 4)
    cases = {
        "shared": os.path.join(base, "shared"),
        "same": durable,
        "inside": os.path.join(durable, "fast"),
        "contains": base,
        "file": os.path.join(base, "file"),
        "read_only": "/sys",
    }
    out: dict[str, Any] = {}
    for name, local in cases.items():
        out[name] = _attempt(lambda local=local: save_one(durable, local, model))
        out[f"{name}_resume"] = _attempt(
            lambda local=local: resume_from_checkpoint(durable, model=model, local_path=local)
        )
    out["left"] = sorted(os.listdir(base)), sorted(os.listdir(durable))
    out["shared_left"] = sorted(os.listdir(cases["shared"]))
    return out


def save_one(durable: str, local: str, model: Any) -> None:
    from smpckpt import save_checkpoint

    save_checkpoint(durable, "t", model=model, local_path=local, replicas=2)


# -- 2: a drain killed, then retried ---------------------------------------------------------------------
def killed_in_drain_of_step3(rank: int, world: int, base: str, durable: str) -> Any:
    """durable_every=3, num_kept_local=2: step1-3; rank 1 dies copying its first file of step3's drain,
    that file begun in ``path`` (a retried drain meets it)."""
    import smpckpt.api._drain as drain_module

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    if rank == 1:
        real_open_sink = drain_module.open_sink

        def dying_open_sink(fs: Any, path: str, **kw: Any) -> Any:
            sink = real_open_sink(fs, path, **kw)
            if "step3_partial" in path:
                sink.write(memoryview(b"the first bytes"))
                os._exit(0)
            return sink

        drain_module.open_sink = dying_open_sink  # type: ignore[assignment]
    ctx, model, opt = tp_model.build(LAYOUT)
    error = ""
    for step in (1, 2, 3):
        tp_model.train_step(ctx, model, opt, step)
        torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
        _save(durable, local, step, model, opt, durable_every=3)
    try:
        wait_for_saves()
    except Exception as exc:  # noqa: BLE001 - reported below
        error = f"{type(exc).__name__}: {exc}"
    from tier_workers import _report

    step3 = os.path.join(durable, "step3_partial")
    left = sorted(os.listdir(step3)) if os.path.isdir(step3) else []
    _report(base, rank, {"error": error, "local": partials(job_dir(local, durable)), "durable_step3": left})
    return error


def retry_after_drain_kill(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """The restarted job: resume (step3, from the fast tier), save step4 and step5 (its drain of step3 is
    retried, said in a warning); then every fast tier lost: resume step3 from the durable tier."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    out: dict[str, Any] = {}
    uc, state, said = _resume(durable, local, 21)
    out["resume"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, uc["step"], rank))}
    ctx, model, opt = tp_model.build(LAYOUT, seed=22)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (4, 5):
            tp_model.train_step(ctx, model, opt, step)
            torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
            _save(durable, local, step, model, opt, durable_every=3)
        wait_for_saves()
    out["warnings"] = [str(w.message) for w in caught if "drain" in str(w.message)]
    dist.barrier()
    out["fast"] = partials(job_dir(local, durable))
    out["durable"] = sorted(os.listdir(durable))
    dist.barrier()
    if rank % 2 == 0:
        shutil.rmtree(local)  # every fast tier lost
    dist.barrier()
    uc, state, _ = _resume(durable, local, 23)
    out["no_fast"] = {**_info(), "uc": uc, "exact": _same(state, _want(base, uc["step"], rank))}
    return out


def abandoned_history_back(rank: int, world: int, base: str) -> dict[str, Any]:
    """step1-9 (step5 drained; replicas=2: each node holds every part; num_kept_local=2 keeps step8, step9);
    node 1's disk snapshotted; every fast tier lost, so the job resumes path's step5 and saves new6 (save 6,
    other values). Node 1 comes back with its old disk: step8 and step9, complete on it alone. tag=None
    resumed the abandoned step9 on every rank, silently; now refused naming both. By tag, either loads;
    going on from new6 (by tag), the next save settles it."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    kw: dict[str, Any] = dict(replicas=2, durable_every=5)
    _states(base, rank, range(1, 10), durable, local, **kw)
    snap = os.path.join(base, "node1-snapshot")
    if rank == 2:
        shutil.copytree(local, snap, symlinks=True)
    dist.barrier()
    if rank in (0, 2):  # both nodes' fast tiers lost
        shutil.rmtree(local)
        os.makedirs(local)
    dist.barrier()
    out: dict[str, Any] = {"after_loss": _attempt(lambda: _resume(durable, local, 21)[0])}
    dist.barrier()
    opts: dict[str, Any] = dict(layout=LAYOUT, specs=tp_model.SPECS, local_path=local)

    def go_on(tag: str, step: int, new: str) -> dict[str, torch.Tensor]:
        """Resume ``tag``, train ``step``, save it as ``new``: this rank's state saved."""
        ctx, model, opt = tp_model.build(LAYOUT, seed=step)
        resume_from_checkpoint(durable, tag, model=model, optimizer=opt, **opts)
        tp_model.train_step(ctx, model, opt, step)
        state = _clone(tp_model.local_state(model, opt))
        save_checkpoint(durable, new, model=model, optimizer=opt, **opts, **kw)
        wait_for_saves()
        dist.barrier()
        return state

    want = go_on("step5", 106, "new6")
    if rank == 2:  # node 1 back, with its old disk
        shutil.rmtree(local)
        shutil.copytree(snap, local, symlinks=True)
    dist.barrier()
    out["none"] = _attempt(lambda: _resume(durable, local, 23)[0])
    dist.barrier()
    for tag, expect in (("new6", want), ("step9", _want(base, 9, rank))):
        uc, state, _ = _resume(durable, local, 24, tag=tag)
        out[tag] = {**_info(), "exact": _same(state, expect)}
        dist.barrier()
    # the job goes on from new6 (by tag) and saves new7, in sight of both histories: tag=None resumes it
    want7 = go_on("new6", 107, "new7")
    out["kept"] = partials(job_dir(local, durable))  # num_kept_local (2) after new7 (hunt72b)
    uc, state, _ = _resume(durable, local, 26)
    out["went_on"] = {**_info(), "exact": _same(state, want7)}
    return out


def fork_beyond_lineage(rank: int, world: int, base: str, ahead_s: int = 0) -> dict[str, Any]:
    """rev63c: as :func:`abandoned_history_back`, the fork 19 saves back, past the 16 a lineage names:
    step1-5 (step5 drained), step6-24 (step23, step24 kept; step24 due for path, its drain lost); every
    fast tier lost, the job resumes step5 and saves new6; node 1 back with its old disk. tag=None resumed
    step24 silently; going on from new6 (by tag), the next save drained step24 into path as its newest.
    ``ahead_s``: step6-24 saved under a clock that far ahead (rev63c F3: resumed silently again)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    kw: dict[str, Any] = dict(replicas=2, num_kept_local=2)
    _states(base, rank, range(1, 6), durable, local, durable_every=5, **kw)
    with _clock(ahead_s):
        _states(base, rank, range(6, 25), durable, local, durable_every=24, **kw)
    snap = os.path.join(base, "node1-snapshot")
    if rank == 0:  # step24's drain never committed (the job died draining)
        shutil.rmtree(os.path.join(durable, "step24_partial"))
        os.unlink(os.path.join(durable, "newest"))
    if rank == 2:
        shutil.copytree(local, snap, symlinks=True)
    dist.barrier()
    if rank in (0, 2):  # both nodes' fast tiers lost
        shutil.rmtree(local)
        os.makedirs(local)
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=106)
    opts: dict[str, Any] = dict(layout=LAYOUT, specs=tp_model.SPECS, local_path=local)
    resume_from_checkpoint(durable, model=model, optimizer=opt, **opts)
    tp_model.train_step(ctx, model, opt, 106)
    want6 = _clone(tp_model.local_state(model, opt))
    save_checkpoint(durable, "new6", model=model, optimizer=opt, durable_every=100, **opts, **kw)
    wait_for_saves()
    dist.barrier()
    if rank == 2:  # node 1 back, with its old disk
        shutil.rmtree(local)
        shutil.copytree(snap, local, symlinks=True)
    dist.barrier()
    out: dict[str, Any] = {"none": _attempt(lambda: _resume(durable, local, 23)[0])}
    dist.barrier()
    for tag, expect in (("step24", _want(base, 24, rank)), ("new6", want6)):  # the job goes on from new6
        uc, state, _ = _resume(durable, local, 24, tag=tag)
        out[tag] = {**_info(), "exact": _same(state, expect)}
        dist.barrier()
    want7 = _clone(tp_model.local_state(model, opt))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["save7"] = _attempt(lambda: _save(durable, local, 7, model, opt, durable_every=100, **kw))
        out["wait"] = _attempt(wait_for_saves)
    out["warned"] = [str(w.message) for w in caught if "step24" in str(w.message)]
    dist.barrier()
    out["path"] = sorted(os.listdir(durable))
    try:  # step7's job saw step24 and went on from new6: settled, as the README says
        uc, state, _ = _resume(durable, local, 26)
        out["went_on"] = {**_info(), "exact": _same(state, want7)}
    except Exception as exc:  # noqa: BLE001 - a refusal is what the test checks against
        out["went_on"] = f"{type(exc).__name__}: {exc}"
    return out


@contextlib.contextmanager
def _clock(ahead_s: int) -> Iterator[None]:
    """Saves made meanwhile stamp ``saved_at_ns`` ``ahead_s`` off (rank 0's host clock then: rev63c F1, F3)."""
    import smpckpt.api._save as save_module

    real = save_module.time
    save_module.time = types.SimpleNamespace(time_ns=lambda: time.time_ns() + ahead_s * 10**9)  # type: ignore[assignment]
    try:
        yield
    finally:
        save_module.time = real  # type: ignore[assignment]


def _drained_newest(durable: str) -> str | None:
    path = os.path.join(durable, "newest")
    return _read(durable, "newest").decode().strip() if os.path.exists(path) else None


def histories(rank: int, world: int, base: str, case: str) -> dict[str, Any]:
    """rev63c, one job (no fork) whose history is told apart without clocks or the 16-save horizon:
    skew_rollback: step1-5 saved under a clock 1 h ahead, the job restarts (true clock), rolls back by
    tag='step4', saves step6: tag=None refused step6 for step5 (saved "later"); skew_plain: step1-2 at
    +1 h, the job resumes step2 and saves step3-19: tag=None refused step19 for step2. rollback_drain:
    step1-6 (step6 due for path, its drain lost), roll back by tag='step4', save new7-new24: new23 drained
    the abandoned step6 into path as its newest. far_drain: as rollback_drain, but every fast tier is lost
    after step6 and node 1 comes back with its old disk (step5, step6) after new6-new23 (the job resumed
    path's step5): new24 drained another history's step6 into path as its newest."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    # rollback_drain keeps all: step6, undrainable, is kept only among the newest saves since hunt64c F3,
    # and must outlive the 16 saves a lineage names
    kw: dict[str, Any] = dict(replicas=2, num_kept_local=None if case in ("skew_plain", "rollback_drain") else 3)
    out: dict[str, Any] = {}
    first, last, back = {"skew_rollback": (5, 6, "step4"), "skew_plain": (2, 19, None)}.get(case, (6, 24, "step4"))
    with _clock(3600 if case.startswith("skew") else 0):
        every = 5 if case.endswith("drain") else 100  # the drains': step5 in path
        _states(base, rank, range(1, min(first, 5) + 1), durable, local, durable_every=every, **kw)
        _states(base, rank, range(6, first + 1), durable, local, durable_every=6, **kw)  # the drains' step6
    snap = os.path.join(base, "node1-snapshot")
    if case.endswith("drain") and rank == 0:  # step6's drain never committed (the job died draining)
        shutil.rmtree(os.path.join(durable, "step6_partial"))
        os.unlink(os.path.join(durable, "newest"))
    if case == "far_drain" and rank == 2:
        shutil.copytree(local, snap, symlinks=True)
    dist.barrier()
    if case == "far_drain":
        if rank in (0, 2):  # both nodes' fast tiers lost: the job resumes path's step5
            shutil.rmtree(local)
            os.makedirs(local)
        back = None
        dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=106)
    # one Checkpointer resumes and saves (rev63c's repro): the saves' options
    o = [Sharding(layout=LAYOUT, specs=tp_model.SPECS), FastTier(local_path=local, durable_every=100, **kw)]
    resume_from_checkpoint(durable, back, model=model, optimizer=opt, options=o)
    out["resumed"] = _info()["tag"]
    said: list[str] = []
    for step in range(first + 1 if case.startswith("skew") else 6 if case == "far_drain" else 7, last + 1):
        if case == "far_drain" and step == last and rank == 2:  # node 1 back, with its old disk
            shutil.rmtree(local)
            shutil.copytree(snap, local, symlinks=True)
        dist.barrier()
        tp_model.train_step(ctx, model, opt, 100 + step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tag = f"step{step}" if case.startswith("skew") else f"new{step}"
            save_checkpoint(durable, tag, model=model, optimizer=opt, options=o)
            wait_for_saves()
        said += [str(w.message) for w in caught if "'step6'" in str(w.message)]
        dist.barrier()
    want = _clone(tp_model.local_state(model, opt))
    out["said"], out["newest"], out["path"] = (
        said,
        _drained_newest(durable),
        sorted(os.listdir(durable)) if os.path.isdir(durable) else [],
    )
    dist.barrier()
    try:
        uc, state, _ = _resume(durable, local, 23)
        out["none"] = {**_info(), "exact": _same(state, want)}
    except Exception as exc:  # noqa: BLE001 - the refusal is what the test checks
        out["none"] = f"{type(exc).__name__}: {exc}"
    return out


def history_cases(rank: int, world: int, base: str) -> dict[str, Any]:
    """One 4-rank world for :func:`histories`' cases and :func:`fork_beyond_lineage` with H1's clock ahead."""
    out: dict[str, Any] = {}
    for name in ("skew_rollback", "skew_plain", "rollback_drain", "far_drain", "deep_fork_ahead"):
        path = os.path.join(base, name)
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        if name == "deep_fork_ahead":
            out[name] = fork_beyond_lineage(rank, world, path, ahead_s=3600)
        else:
            out[name] = histories(rank, world, path, name)
        dist.barrier()
    return out


# -- rev58b F6: the drain copies from a peer's intact replica ---------------------------------------------
def _read(folder: str, name: str) -> bytes:
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def drain_from_a_replica(rank: int, world: int, base: str) -> dict[str, Any]:
    """replicas=2 (each node holds every file), durable_every=2. step2's drain fails (``path``'s storage
    refuses rank 0's first file: injected); a byte of the last block of node 0's copy of a file rank 0
    wrote is flipped; step3 drains step2 again, its copy of that file failing after its first blocks were
    written to ``path`` (each unit is read alone here): it must come from node 1's intact replica (it came from rank 0's damaged copy,
    so every retry failed until a resume healed it). Then step4's drain fails alike, and the same byte of
    BOTH nodes' copies of a step4 file is flipped: step5's retry fails naming the file and both nodes,
    ``path`` gets nothing of step4, and the fast tier keeps it."""
    import errno

    import smpckpt.api._drain as drain_module
    import smpckpt.storage.tools as tools
    from smpckpt.storage import Manifest, verify_checkpoint
    from smpckpt.storage.format.manifest import FileRecord

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    kw: dict[str, Any] = dict(replicas=2, durable_every=2)
    refuse, real_open_sink = {"step2", "step4"}, drain_module.open_sink
    real_chunk = tools._READ_CHUNK
    tools._READ_CHUNK = 1  # each check unit read (and copied) alone: a copy can fail after it began

    partial = {"written": 0, "aborted": 0}  # rank 0's copies of step2 in path: what went before an abort

    class Counted:
        def __init__(self, sink: Any) -> None:
            self.sink, self.borrows = sink, sink.borrows

        def write(self, data: memoryview) -> None:
            partial["written"] += len(data)
            self.sink.write(data)

        def commit(self) -> None:
            self.sink.commit()

        def abort(self) -> None:
            partial["aborted"] += 1
            self.sink.abort()

    def refusing(fs: Any, path: str, **kws: Any) -> Any:  # each tag's first drain, once, on rank 0
        tag = next((t for t in sorted(refuse) if f"{t}_partial" in path), None)
        if tag is not None:
            refuse.discard(tag)
            raise OSError(errno.ENOSPC, "injected: no space left on path's storage", path)
        sink = real_open_sink(fs, path, **kws)
        return Counted(sink) if victim and "step2_partial" in path and path.endswith(victim) else sink

    def victim_of(step: int) -> FileRecord:
        """Rank 0's file of the most check units (the first of them)."""
        with open(os.path.join(node0, f"step{step}_partial", MANIFEST), "rb") as f:
            mine = [r for r in Manifest.from_bytes(f.read()).files if r.rank == 0]
        return min(mine, key=lambda r: (-len(list(r.unit_ranges())), r.name))

    node0, node1 = (job_dir(node_dir(os.path.join(base, "fast"), r), durable) for r in (0, 2))
    out: dict[str, Any] = {}
    victim = ""  # rank 0's file damaged in step2 (chosen after that save)
    if rank == 0:
        drain_module.open_sink = refusing  # type: ignore[assignment]
    try:
        ctx, model, opt = tp_model.build(LAYOUT)

        def save(step: int) -> str:
            tp_model.train_step(ctx, model, opt, step)
            torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
            logged: list[str] = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
            logging.getLogger("smpckpt.api").addHandler(handler)  # the drain thread logs what it copied from a peer
            try:
                _save(durable, local, step, model, opt, **kw)
                got = _attempt(wait_for_saves)
            finally:
                logging.getLogger("smpckpt.api").removeHandler(handler)
            out.setdefault("warnings", []).extend(m for m in logged if "drain" in m)
            dist.barrier()
            return got

        out["save1"], out["save2"] = save(1), save(2)  # step2's drain refused
        rec = victim_of(2)
        victim, out["victim_units"] = rec.name, len(list(rec.unit_ranges()))
        if rank == 0:  # a byte of its last block: the copy fails after its first blocks were written to path
            _flip(os.path.join(node0, "step2_partial", victim), rec.block_ends[-1] - 3)
        dist.barrier()
        out["save3"] = save(3)  # drains step2 again: from node 1's replica of the victim
        out["partial"] = partial
        drained = os.path.join(durable, "step2_partial")
        if rank == 0:
            out["victim_intact"] = _attempt(lambda: _read(drained, victim) == _read(node1 + "/step2_partial", victim))
            out["verify"] = _attempt(lambda: verify_checkpoint(drained).problems)

        def from_path() -> dict[str, Any]:
            _, fresh, fresh_opt = tp_model.build(LAYOUT, seed=31)
            uc = resume_from_checkpoint(
                durable, "step2", model=fresh, optimizer=fresh_opt, layout=LAYOUT, specs=tp_model.SPECS
            )
            return {"uc": uc, "exact": _same(tp_model.local_state(fresh, fresh_opt), _want(base, 2, rank))}

        out["from_path"] = _attempt(from_path)
        dist.barrier()
        out["save4"] = save(4)  # step4's drain refused
        victim4 = victim_of(4).name
        out["victim4"] = victim4
        if rank == 0:
            for node in (node0, node1):
                _flip(os.path.join(node, "step4_partial", victim4))
        dist.barrier()
        out["save5"] = save(5)  # step5's retry of step4: no intact copy anywhere
        out["durable"] = sorted(os.listdir(durable))
        out["newest"] = _attempt(lambda: _read(durable, "newest").strip())
        out["fast"] = [partials(node) for node in (node0, node1)]
        out["step4_kept"] = [os.path.isfile(os.path.join(n, "step4_partial", MANIFEST)) for n in (node0, node1)]
    finally:
        drain_module.open_sink = real_open_sink  # type: ignore[assignment]
        tools._READ_CHUNK = real_chunk
    return out


def new_cases(rank: int, world: int, base: str) -> dict[str, Any]:
    """One 4-rank world for the cases above that need no killed rank."""
    out: dict[str, Any] = {}
    for name, fn in (
        ("refused", refused_folders),
        ("jobs", jobs_apart),
        ("slot", slot_of_incomplete),
        ("unsafe", unsafe_folders),
        ("heal", heal_from_peers),
        ("stale", stale_node_after_tag_reuse),
        ("fork", abandoned_history_back),
        ("deep_fork", fork_beyond_lineage),
        ("replica", drain_from_a_replica),
    ):
        path = os.path.join(base, name)
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        out[name] = fn(rank, world, path)
        dist.barrier()
    return out


# -- rev62a: a copy some node cannot read, or reads wrong, while another node holds it intact ---------------
FETCH_FAULTS = ("eio", "gone", "eio_all", "manifest", "drain", "stuck", "eio_part", "full", "full_md", "full_path")


def fetch_faults(rank: int, world: int, base: str, only: str = "") -> dict[str, Any]:
    """4 nodes of 1 rank, replicas=2, step1-2 saved per case (``only``: the cases named). eio: node 1
    lacks step2's metadata and node 0 (its first holder) gets EIO reading it (rev62a F1: a hang); gone:
    the same, node 0's read finding nothing (F5); eio_all: every node's read of it fails (step1, agreed);
    manifest: node 1 lacks the manifest, node 2 holds a corrupt part (F2); drain: step2's drain pending,
    node 0's metadata corrupt at its size (F3); stuck: node 0's corrupt part cannot be removed (F4);
    eio_part: node 2 cannot read (EIO) the first part it sends, sending it again or checking it (rev63c:
    the retry fetched again every part the failed attempt had fetched); full: node 1 lacks its own part
    and its disk is full (ENOSPC writing the part it fetches: hunt64c), then has room again; full_md: the
    same with node 1's metadata (ENOSPC writing the copy a peer sends); full_path: as full, step2 drained to
    path (its copy of the same save loads instead)."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    out: dict[str, Any] = {}
    for case in FETCH_FAULTS:
        if not only or case in only.split(","):
            os.makedirs(os.path.join(base, case), exist_ok=True)
            out[case] = _fetch_fault(rank, os.path.join(base, case), case)
            dist.barrier()
    return out


def _fetch_fault(rank: int, base: str, case: str) -> dict[str, Any]:
    import errno

    import smpckpt.api._fast_resume as resume_module
    import smpckpt.api._tiers as tiers_module
    import smpckpt.storage.tier.reader as reader_module
    from smpckpt.storage.backends._folder import Folder

    local, durable = node_dir(os.path.join(base, "fast"), rank, 1), os.path.join(base, "durable")
    every = 2 if case == "drain" else 1 if case == "full_path" else 100
    _states(base, rank, (1, 2), durable, local, durable_every=every, num_kept_local=None)
    folder = os.path.join(job_dir(local, durable), "step2_partial")
    md = _metadata_name(folder)
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        victim = min(r["name"] for r in json.loads(f.read())["files"] if r.get("rank") == rank)
    real_read, real_remove, real_check = tiers_module.read_bytes_or_none, Folder.remove, resume_module.check_blocks
    real_publish = Folder.publish
    dist.barrier()

    def read(fs: Any, path: str) -> bytes | None:
        if "step2_partial" in path and os.path.basename(path) == md:
            if case == "gone":
                return None
            raise OSError(errno.EIO, "injected I/O error", path)
        return real_read(fs, path)

    def remove(self: Any, names: Any) -> list[str]:
        names = list(names)
        return real_remove(self, [n for n in names if n != victim]) + [victim] * (victim in names)

    if rank == 1 and case in ("eio", "gone", "eio_all", "manifest"):
        os.unlink(os.path.join(folder, MANIFEST if case == "manifest" else md))
    if case == "eio_all" or (rank == 0 and case in ("eio", "gone")):
        tiers_module.read_bytes_or_none = read  # type: ignore[assignment]
    if rank == 2 and case == "manifest":
        _flip(os.path.join(folder, victim))
    if rank == 0 and case == "drain":  # step2's durable copy gone: the next save drains it again
        for name in os.listdir(durable):
            if name.startswith("step2") or name == "newest":
                p = os.path.join(durable, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        _flip(os.path.join(folder, md))
    if rank == 0 and case == "stuck":
        _flip(os.path.join(folder, victim))
        Folder.remove = remove  # type: ignore[method-assign]

    hit: list[str] = []  # eio_part: the first part node 2 sends (the schedule picks it), then its check
    lock = threading.Lock()

    def unreadable(path: Any, *args: Any, **kw: Any) -> Any:  # received files are opened by fd
        with lock:
            if isinstance(path, str) and os.path.basename(path) in (hit or [os.path.basename(path)]):
                hit[:] = [os.path.basename(path)]
                raise OSError(errno.EIO, "injected I/O error", path)
        return open(path, *args, **kw)

    def check(fs: Any, path: str, *args: Any, **kw: Any) -> bool:
        if os.path.basename(path) in hit:
            raise OSError(errno.EIO, "injected I/O error", path)
        return real_check(fs, path, *args, **kw)

    if rank == 2 and case == "eio_part":  # its sends (open) and its check (check_blocks) of the victim fail
        reader_module.open = unreadable  # type: ignore[attr-defined]
        resume_module.check_blocks = check

    class Full(reader_module.Incoming):  # node 1's part of step2 received on a full disk: its write fails
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            if self.path == os.path.join(folder, victim) and self.file is not None:
                self.file = types.SimpleNamespace(write=self.enospc, close=self.file.close, fileno=self.file.fileno)

        @staticmethod
        def enospc(data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def publish(self: Any, name: str, *args: Any, **kw: Any) -> None:
        if name == md and self.path.rstrip("/").endswith("step2_partial"):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, name))
        real_publish(self, name, *args, **kw)

    real_incoming = reader_module.Incoming
    if rank == 1 and case in ("full", "full_path"):  # node 1 lacks its own part and cannot store it fetched from node 2
        os.unlink(os.path.join(folder, victim))
        reader_module.Incoming = Full  # type: ignore[misc]
    if rank == 1 and case == "full_md":  # node 1 lacks the metadata and cannot store it
        os.unlink(os.path.join(folder, md))
        Folder.publish = publish  # type: ignore[method-assign]
    dist.barrier()
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("smpckpt.api").addHandler(handler)
    try:
        if case == "drain":
            ctx, model, opt = tp_model.build(LAYOUT, seed=3)
            got: dict[str, Any] = {"save3": _attempt(lambda: _save(durable, local, 3, model, opt, durable_every=2))}
            got["wait"] = _attempt(wait_for_saves)
            got["durable"] = sorted(os.listdir(durable))
        else:
            if case in ("full", "full_md"):  # the disk full: raised, never an older save; then room again: step2
                got = {"full": _attempt(lambda: _resume(durable, local, 11)[0])}
                got["after"] = _info()["tag"] if got["full"].startswith("ok") else None
                reader_module.Incoming, Folder.publish = real_incoming, real_publish  # type: ignore[misc]
            uc, state, said = _resume(durable, local, 11)
            tag = _info()["tag"]
            got = {**(got if case in ("full", "full_md") else {}), "tag": tag, "uc": uc, "warnings": said}
            got["tier"] = _info()["tier"]
            got["exact"] = _same(state, _want(base, int(tag[4:]), rank))
            got["fetched"] = sorted({name for name, _, _ in _info()["from_peers"]})  # by the load that loaded
    except Exception as exc:  # noqa: BLE001 - the test shows it
        got = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        logging.getLogger("smpckpt.api").removeHandler(handler)
        tiers_module.read_bytes_or_none, Folder.remove = real_read, real_remove  # type: ignore[method-assign]
        resume_module.check_blocks = real_check
        vars(reader_module).pop("open", None)
        reader_module.Incoming, Folder.publish = real_incoming, real_publish  # type: ignore[misc]
    got["logged"], got["victim"] = logged, (hit or [victim])[0]
    got["md"] = _read(folder, md) if os.path.exists(os.path.join(folder, md)) else None
    return got


def commit_partly_failed(rank: int, world: int, base: str) -> dict[str, Any]:
    """durable_every=3, one Checkpointer: step1-2 saved; node 1's commit of step3 fails (ENOSPC) after every
    node agreed it holds its share, node 0's commits; then step4 (hunt64c F2); step5's commit finds another
    save's manifest on every node (rev64b R4)."""
    import errno

    import smpckpt.api._fast_save as fast_save

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local, durable = node_dir(os.path.join(base, "fast"), rank), os.path.join(base, "durable")
    real = fast_save.commit_node_copy

    def full(folder: str, *args: Any, **kw: Any) -> Any:
        if folder.endswith("step3_partial"):
            raise OSError(errno.ENOSPC, "No space left on device", folder)
        return real(folder, *args, **kw)

    def exists(folder: str, *args: Any, **kw: Any) -> Any:  # step5: a racing save's manifest on every node
        raise CheckpointExists(f"{folder} holds another committed checkpoint of this tag")

    ctx, model, opt = tp_model.build(LAYOUT)
    out: dict[str, Any] = {}
    for step in (1, 2, 3, 4, 5):
        tp_model.train_step(ctx, model, opt, step)
        inject = full if rank == 2 and step == 3 else exists if step == 5 else real
        fast_save.commit_node_copy = inject  # type: ignore[assignment]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[f"save{step}"] = _attempt(lambda s=step: _save(durable, local, s, model, opt, durable_every=3))
            out[f"wait{step}"] = _attempt(wait_for_saves)
        out[f"said{step}"] = [str(w.message) for w in caught if "deprecated" not in str(w.message)]
    fast_save.commit_node_copy = real  # type: ignore[assignment]
    dist.barrier()
    out["durable"] = sorted(os.listdir(durable)) if os.path.isdir(durable) else []
    return out


@contextlib.contextmanager
def _path_full(logged: list[str]) -> Iterator[None]:
    """Every drain's sink refused (``path``'s storage full: ENOSPC); ``smpckpt.api``'s warnings into ``logged``
    (retention warns on the save's thread and on the drain's)."""
    import errno

    import smpckpt.api._drain as drain_module

    def full(fs: Any, path: str, **kw: Any) -> Any:
        raise OSError(errno.ENOSPC, "injected: no space left on path's storage", path)

    real, handler = drain_module.open_sink, logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("smpckpt.api").addHandler(handler)
    drain_module.open_sink = full  # type: ignore[assignment]
    try:
        yield
    finally:
        drain_module.open_sink = real  # type: ignore[assignment]
        logging.getLogger("smpckpt.api").removeHandler(handler)


def failed_drains_pile_up(rank: int, world: int, base: str) -> dict[str, Any]:
    """hunt64c F3: 2 nodes of 1 rank, replicas=2, durable_every=1, num_kept_local=1; ``path``'s storage
    full through five saves: what each node's fast tier holds after each, and what retention warned. Then
    a restarted job resumes (tag-less), ``path`` has room again, a save not due for ``path`` (durable_every=4:
    save 6) drains the newest again, and ``path`` alone resumes it. Second job (``durable2``), path full:
    step1-4 kept (num_kept_local=None, durable_every=2), step4's part lost on both nodes (undrainable); then
    num_kept_local=1: step5 drains step2 again -- what the fast tier holds after it, what was warned."""
    from smpckpt import ParallelLayout

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    layout, durable = ParallelLayout(tp=2, dp=1), os.path.join(base, "durable")
    local = node_dir(os.path.join(base, "fast"), rank, 1)

    def save(step: int, model: Any, opt: Any, every: int, keep: int | None = 1, root: str = durable) -> Any:
        return save_checkpoint(
            root,
            f"step{step}",
            model=model,
            optimizer=opt,
            user_content={"step": step},
            layout=layout,
            specs=tp_model.SPECS,
            options=FastTier(local_path=local, replicas=2, durable_every=every, num_kept_local=keep),
        )

    def resumed(seed: int, **kw: Any) -> dict[str, Any]:
        _, fresh, fresh_opt = tp_model.build(layout, seed=seed)
        uc = resume_from_checkpoint(
            durable, model=fresh, optimizer=fresh_opt, layout=layout, specs=tp_model.SPECS, **kw
        )
        want = _want(base, uc["step"], rank)
        return {**_info(), "uc": uc, "exact": _same(tp_model.local_state(fresh, fresh_opt), want)}

    out: dict[str, Any] = {"fast": [], "wait": []}
    logged: list[str] = []
    with _path_full(logged):
        ctx, model, opt = tp_model.build(layout)
        for step in range(1, 6):
            tp_model.train_step(ctx, model, opt, step)
            torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
            save(step, model, opt, every=1)
            out["wait"].append(_attempt(wait_for_saves))
            dist.barrier()  # every node's retention done
            out["fast"].append(partials(job_dir(local, durable)))
    out["logged"] = [m for m in logged if "never reached" in m]
    out["resumed"] = _attempt(lambda: resumed(7, options=FastTier(local_path=local)))
    ctx, model, opt = tp_model.build(layout, seed=9)  # the restarted job goes on from its resume
    resume_from_checkpoint(
        durable, model=model, optimizer=opt, layout=layout, specs=tp_model.SPECS, options=FastTier(local_path=local)
    )
    tp_model.train_step(ctx, model, opt, 6)
    torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state6_rank{rank}.pt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["save6"] = _attempt(lambda: save(6, model, opt, every=4))
        out["wait6"] = _attempt(wait_for_saves)
    out["said6"] = [str(w.message) for w in caught if "drains it to" in str(w.message)]
    dist.barrier()
    out["durable"] = sorted(os.listdir(durable))
    out["fast6"] = partials(job_dir(local, durable))
    out["from_path"] = _attempt(lambda: resumed(8))  # path alone: no fast tier

    root2, logged2 = os.path.join(base, "durable2"), []
    job2 = job_dir(local, root2)
    with _path_full(logged2), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the drains' failures and the retries' warnings: logged2 tells
        for step in range(1, 5):
            save(step, model, opt, every=2, keep=None, root=root2)
            _attempt(wait_for_saves)
        dist.barrier()
        lost = sorted(n for n in os.listdir(os.path.join(job2, "step4_partial")) if n.endswith(".distcp"))[0]
        os.unlink(os.path.join(job2, "step4_partial", lost))  # on both nodes: step4 cannot be drained
        dist.barrier()
        save(5, model, opt, every=2, root=root2)
        _attempt(wait_for_saves)
        dist.barrier()
    out["fast2"] = partials(job2)
    out["logged2"] = [m for m in logged2 if "never reached" in m or "cannot be drained" in m]
    return out
