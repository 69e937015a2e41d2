"""Rank functions for the tiered-checkpoint tests (tests/api/test_tiers_ranks.py): 2 simulated nodes of 2 ranks
each (``LOCAL_WORLD_SIZE=2``), every node's fast tier its own folder under ``base``."""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import tp_model

from smpckpt import ParallelLayout, last_resume_info, resume_from_checkpoint, save_checkpoint, wait_for_saves
from smpckpt.api._tiers import durable_key, job_folder

LAYOUT = ParallelLayout(tp=2, dp=2)


def node_dir(base: str, rank: int, local_world_size: int = 2) -> str:
    return os.path.join(base, f"node{rank // local_world_size}")


def job_dir(local: str, durable: str) -> str:
    """The folder of the job whose durable root is ``durable`` in the fast tier ``local``."""
    return job_folder(local, durable_key(durable, None))


def partials(folder: str) -> list[str] | None:
    """The ``{tag}_partial`` folders in ``folder`` (``None``: no such folder)."""
    return sorted(n for n in os.listdir(folder) if n.endswith("_partial")) if os.path.isdir(folder) else None


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _info() -> dict[str, Any]:
    info = last_resume_info()
    assert info is not None
    return {"tag": info.tag, "tier": info.tier, "from_peers": info.from_peers, "path_taken": info.path_taken}


def five_saves(rank: int, world: int, base: str, durable: str, async_save: bool = False) -> dict[str, Any]:
    """Five saves with replicas=2, durable_every=3; each rank's state after each save is left in
    ``base`` for the restarted job (:func:`restart_after_five`) to compare with."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    ctx, model, opt = tp_model.build(LAYOUT)
    for step in range(1, 6):
        tp_model.train_step(ctx, model, opt, step)
        fut = save_checkpoint(
            durable,
            f"step{step}",
            model=model,
            optimizer=opt,
            user_content={"step": step},
            layout=LAYOUT,
            specs=tp_model.SPECS,
            local_path=local,
            replicas=2,
            durable_every=3,
            async_save=async_save,
        )
        if fut is not None:
            fut.result()
        torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
    wait_for_saves()
    dist.barrier()  # a node's first rank may still be applying num_kept_local after the others returned
    return {"local_after_saves": partials(job_dir(local, durable)), "durable_after_saves": sorted(os.listdir(durable))}


def restart_after_five(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """A restarted job (fresh processes) after :func:`five_saves`: node 1's fast tier lost, resume; then
    every fast tier lost, resume. Whether each resume was bit-exact."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    out: dict[str, Any] = {}
    if rank == 2:
        shutil.rmtree(node_dir(base, rank))  # node 1 lost
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=99)
    uc = resume_from_checkpoint(
        durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
    )
    want = torch.load(os.path.join(base, f"state{uc['step']}_rank{rank}.pt"))
    out["one_node_lost"] = {**_info(), "uc": uc, "exact": _same(tp_model.local_state(model, opt), want)}
    out["local_after_heal"] = partials(job_dir(local, durable))
    dist.barrier()
    if rank % 2 == 0:
        shutil.rmtree(node_dir(base, rank))  # every fast tier lost
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=98)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uc = resume_from_checkpoint(
            durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
        )
    want = torch.load(os.path.join(base, f"state{uc['step']}_rank{rank}.pt"))
    out["all_lost"] = {**_info(), "uc": uc, "exact": _same(tp_model.local_state(model, opt), want)}
    return out


def _save(durable: str, local: str, step: int, model: Any, opt: Any, **kw: Any) -> Any:
    return save_checkpoint(
        durable,
        f"step{step}",
        model=model,
        optimizer=opt,
        user_content={"step": step},
        layout=LAYOUT,
        specs=tp_model.SPECS,
        local_path=local,
        **kw,
    )


def _report(base: str, rank: int, what: Any) -> None:
    """A dead rank makes run_world raise and drop the others' values: each rank leaves its own in a file."""
    import pickle

    with open(os.path.join(base, f"report{rank}.pkl"), "wb") as f:
        pickle.dump(what, f)


def _killed_job(rank: int, base: str, durable: str, *, durable_every: int, victim: int, kill: Any) -> str:
    """Save step1 (drained when ``durable_every`` is 1), then step2 with ``kill()`` run first on rank
    ``victim`` (it patches the library so the rank dies at one point of that save). Each state is left
    in ``base`` for the restarted job; each surviving rank reports its error and its folder listings."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    ctx, model, opt = tp_model.build(LAYOUT)
    text = ""
    for step in (1, 2):
        tp_model.train_step(ctx, model, opt, step)
        torch.save(_clone(tp_model.local_state(model, opt)), os.path.join(base, f"state{step}_rank{rank}.pt"))
        if step == 2 and rank == victim:
            kill()
        try:
            _save(durable, local, step, model, opt, durable_every=durable_every)
            wait_for_saves()
            text = "no error"
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            if step == 1:
                raise
            text = f"{type(exc).__name__}: {exc}"
    step2 = os.path.join(job_dir(local, durable), "step2_partial")
    _report(
        base,
        rank,
        {
            "error": text,
            "local": partials(job_dir(local, durable)),
            "step2": sorted(os.listdir(step2)) if os.path.isdir(step2) else None,
        },
    )
    return text


def _die() -> None:
    os._exit(0)  # status 0: the harness would otherwise SIGTERM the other ranks at once


def killed_in_replication(rank: int, world: int, base: str, durable: str) -> Any:
    """During step2's replica transfers (sent while the files are written) rank 3 dies after announcing
    its first file."""
    import smpckpt.storage.tier.writer as stream

    def kill() -> None:
        real_send = stream._Sender._send

        def dying_send(self: Any, kind: int, *args: Any) -> None:
            real_send(self, kind, *args)
            if kind == stream.OPEN:  # "a file follows", then death
                _die()

        stream._Sender._send = dying_send  # type: ignore[method-assign]

    return _killed_job(rank, base, durable, durable_every=5, victim=3, kill=kill)


def killed_in_drain(rank: int, world: int, base: str, durable: str) -> Any:
    """Every save durable: step1 drains; during step2's drain rank 1 dies copying its first file."""
    import smpckpt.api._drain as drain_module

    def kill() -> None:
        real_open_sink = drain_module.open_sink

        def dying_open_sink(fs: Any, path: str, **kw: Any) -> Any:
            if "step2_partial" in path:
                _die()
            return real_open_sink(fs, path, **kw)

        drain_module.open_sink = dying_open_sink  # type: ignore[assignment]

    return _killed_job(rank, base, durable, durable_every=1, victim=1, kill=kill)


def killed_between_node_commits(rank: int, world: int, base: str, durable: str) -> Any:
    """In step2, node 1's first rank (rank 2) dies just before committing its node's copy, after node 0
    may have committed its own: step2 is then committed and complete across the nodes."""
    import smpckpt.api._fast_save as fast_save

    def kill() -> None:
        real_commit = fast_save.commit_node_copy

        def dying_commit(folder: str, *args: Any, **kwargs: Any) -> Any:
            if "step2_partial" in folder:
                _die()
            return real_commit(folder, *args, **kwargs)

        fast_save.commit_node_copy = dying_commit  # type: ignore[assignment]

    return _killed_job(rank, base, durable, durable_every=5, victim=2, kill=kill)


def resume_after(rank: int, world: int, base: str, durable: str, drop_fast: bool, then_save: int | None) -> Any:
    """A restarted job: resume (after deleting every fast tier when ``drop_fast``), compare with the
    states the killed job left per rank, then optionally save ``then_save`` again and resume it."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    if drop_fast and rank % 2 == 0 and os.path.isdir(local):
        shutil.rmtree(local)
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=97)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uc = resume_from_checkpoint(
            durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
        )
    step = uc["step"]
    want = torch.load(os.path.join(base, f"state{step}_rank{rank}.pt"))
    out: dict[str, Any] = {**_info(), "uc": uc, "exact": _same(tp_model.local_state(model, opt), want)}
    if then_save is not None:
        _save(durable, local, then_save, model, opt, durable_every=5)
        ctx, model2, opt2 = tp_model.build(LAYOUT, seed=96)
        uc2 = resume_from_checkpoint(
            durable, model=model2, optimizer=opt2, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
        )
        out["after_resave"] = {
            **_info(),
            "uc": uc2,
            "exact": _same(tp_model.local_state(model2, opt2), tp_model.local_state(model, opt)),
        }
    return out


def save_for_reshard(rank: int, world: int, base: str, durable: str) -> Any:
    """4 ranks (tp=2, dp=2), 2 nodes: two saves (the second only in the fast tier); the global state."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    ctx, model, opt = tp_model.build(LAYOUT)
    for step in (1, 2):
        tp_model.train_step(ctx, model, opt, step)
        _save(durable, local, step, model, opt, durable_every=2 if step == 1 else 3)
    wait_for_saves()
    return tp_model.local_state(model, opt)


def resume_resharded(rank: int, world: int, base: str, durable: str) -> Any:
    """2 ranks (tp=2), one rank per node (LOCAL_WORLD_SIZE=1): each reads the old node folder of its
    number; the world and layout changed, so the load reshards from the fast tier."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    layout = ParallelLayout(tp=2)
    ctx, model, opt = tp_model.build(layout, seed=95)
    uc = resume_from_checkpoint(
        durable,
        model=model,
        optimizer=opt,
        layout=layout,
        specs=tp_model.SPECS,
        local_path=os.path.join(base, f"node{rank}"),
    )
    info = last_resume_info()
    assert info is not None
    return {**_info(), "uc": uc, "layout_changed": info.layout_changed, "state": tp_model.local_state(model, opt)}


def refusals(rank: int, world: int, base: str, durable: str) -> Any:
    """Errors every rank must get, by name: no LOCAL_WORLD_SIZE; node-mates naming different folders."""
    from torch import nn

    if rank == 0:
        os.makedirs(base, exist_ok=True)
    dist.barrier()
    model = nn.Linear(4, 4)
    out = {}
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        save_checkpoint(durable, "a", model=model, local_path=node_dir(base, rank))
        out["no_lws"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        out["no_lws"] = f"{type(exc).__name__}: {exc}"
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        save_checkpoint(durable, "b", model=model, local_path=os.path.join(base, f"rank{rank}"))
        out["mates_differ"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        out["mates_differ"] = f"{type(exc).__name__}: {exc}"
    out["left"] = sorted(os.listdir(base))
    return out


def main_world(rank: int, world: int, base: str) -> dict[str, Any]:
    """One 4-rank world for the cases that need no killed rank (spawning costs seconds on 2 cores)."""
    out: dict[str, Any] = {"refusals": refusals(rank, world, os.path.join(base, "refusals"), os.path.join(base, "r"))}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["sync"] = five_saves(rank, world, os.path.join(base, "sync", "fast"), os.path.join(base, "sync", "durable"))
    out["async"] = five_saves(
        rank, world, os.path.join(base, "async", "fast"), os.path.join(base, "async", "durable"), True
    )
    out["reshard"] = save_for_reshard(
        rank, world, os.path.join(base, "reshard", "fast"), os.path.join(base, "reshard", "durable")
    )
    return out


def restarted(rank: int, world: int, base: str, saved: str) -> dict[str, Any]:
    """One restarted 4-rank job for every case: the five saves of ``saved`` (sync and async), and the
    killed jobs under ``base`` (replication kill: then save step2 again; drain kill: then lose every
    fast tier and resume the durable one; kill between the node commits)."""
    out = {
        mode: restart_after_five(rank, world, os.path.join(saved, mode, "fast"), os.path.join(saved, mode, "durable"))
        for mode in ("sync", "async")
    }
    out.update(resume_killed(rank, world, base))
    from tier_jobs_workers import retry_after_drain_kill  # it imports this module

    drain3 = os.path.join(base, "drain3")
    out["retry"] = retry_after_drain_kill(rank, world, os.path.join(drain3, "fast"), os.path.join(drain3, "durable"))
    return out


def resume_killed(rank: int, world: int, base: str) -> dict[str, Any]:
    """After the killed jobs: resume each."""
    rep, drain = os.path.join(base, "replication"), os.path.join(base, "drain")
    out = {"replication": resume_after(rank, world, os.path.join(rep, "fast"), os.path.join(rep, "durable"), False, 2)}
    out["drain"] = resume_after(rank, world, os.path.join(drain, "fast"), os.path.join(drain, "durable"), False, None)
    commit = os.path.join(base, "commit")
    out["commit"] = resume_after(
        rank, world, os.path.join(commit, "fast"), os.path.join(commit, "durable"), False, None
    )
    dist.barrier()
    out["drain_no_fast"] = resume_after(
        rank, world, os.path.join(drain, "fast"), os.path.join(drain, "durable"), True, None
    )
    return out


def path_cases(rank: int, world: int, base: str, durable: str, s3: str, up: Any, down: Any) -> dict[str, Any]:
    """(test_tiers_path.py) ``durable`` emptied after two drains, and the S3 root ``s3`` unreachable (``down``:
    its options at a dead endpoint): what every rank gets."""
    from torch import nn

    from smpckpt import FastTier, Location, ResumeOptions

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    fast = FastTier(local_path=node_dir(base, rank), replicas=2)
    torch.manual_seed(1)
    model, out = nn.Linear(4, 4), {}

    def attempt(name: str, fn: Any) -> None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
            out[name] = ("ok", [str(w.message) for w in caught if "unreachable" in str(w.message)])
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            out[name] = ("error", f"{type(exc).__name__}: {exc}")

    for tag in ("a1", "a2"):
        save_checkpoint(durable, tag, model=model, options=fast)
    wait_for_saves()
    if rank == 0:
        shutil.rmtree(durable)
    dist.barrier()
    attempt(
        "emptied",
        lambda: resume_from_checkpoint(durable, model=nn.Linear(4, 4), options=[fast, ResumeOptions(missing_ok=True)]),
    )
    later = FastTier(local_path=node_dir(base, rank), replicas=2, durable_every=3)
    save_checkpoint(Location(s3, storage_options=up), "b1", model=model, options=later)
    attempt("save_down", lambda: save_checkpoint(Location(s3, storage_options=down), "b2", model=model, options=later))
    attempt(
        "resume_down",
        lambda: resume_from_checkpoint(Location(s3, storage_options=down), model=nn.Linear(4, 4), options=fast),
    )
    got = nn.Linear(4, 4)
    attempt(
        "tag_down",
        lambda: resume_from_checkpoint(Location(s3, storage_options=down), tag="b2", model=got, options=fast),
    )
    out["exact"] = all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), model.state_dict().values()))
    out["old_disk"] = node_back_with_an_old_drain_record(rank, base + "-old-disk", durable + "-old-disk")
    out["fresh_node0"] = fresh_node0_after_plain_saves(rank, base + "-fresh", durable + "-fresh")
    out["fresh_node0_resumed"] = fresh_node0_after_a_path_resume(rank, base + "-resumed", durable + "-resumed")
    return out


def node_back_with_an_old_drain_record(rank: int, base: str, durable: str) -> Any:
    """(test_tiers_path.py) c2 drained, node 0's folder copied (its disk); c3, c4 saved, c4 drained and
    ``path``'s retention (1) removed c2; node 0 back with that old disk, its drain record naming c2 alone
    (node 1's names c4): what a tag-less resume loads, or its error."""
    from torch import nn

    from smpckpt import FastTier, Retention

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    options = [FastTier(local_path=local, replicas=2, durable_every=2), Retention(num_kept_partial_checkpoints=1)]
    torch.manual_seed(2)
    model, old = nn.Linear(4, 4), os.path.join(base, "node0-old-disk")
    for tag in ("c1", "c2", "c3", "c4"):
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(durable, tag, model=model, options=options)
        if tag == "c2":
            wait_for_saves()
            dist.barrier()
            if rank == 0:
                shutil.copytree(local, old)
    wait_for_saves()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local)
        os.rename(old, local)  # node 0 back with its old disk (c1, c2 and the record of c2's drain)
    dist.barrier()
    got = _resume_tagless(durable, local, model)
    if isinstance(got, dict):
        got["path"] = sorted(os.listdir(durable))
    # rev72b M1: node 1's record an older version's (tags only); path emptied, a new run saves c2 and c4 there:
    # node 0's record knows c2's save id, so node 1's tags-only names match nothing (the new run's c4 was loaded
    # over by the old run's fast copy)
    dist.barrier()
    if rank == 2:
        with open(os.path.join(job_dir(local, durable), "smpckpt.drained.json"), "w") as f:
            f.write('{"drained": ["c4", "c2"]}')
    if rank == 0:
        shutil.rmtree(durable)
    dist.barrier()
    for tag in ("c2", "c4"):
        save_checkpoint(durable, tag, model=nn.Linear(4, 4))
    wait_for_saves()
    dist.barrier()
    return {"old_disk": got, "tags_only_new_run": _resume_tagless(durable, local, model)}


def _resume_tagless(durable: str, local: str, model: Any) -> Any:
    """A tag-less tiered resume: what it loaded (bit-exactly ``model``'s?), or its error."""
    from torch import nn

    from smpckpt import FastTier

    got = nn.Linear(4, 4)
    try:
        resume_from_checkpoint(durable, model=got, options=FastTier(local_path=local))
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}"
    exact = all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), model.state_dict().values()))
    return {**_info(), "exact": exact}


def fresh_node0_after_plain_saves(rank: int, base: str, durable: str) -> Any:
    """(test_tiers_path.py, rev72b H1) c1..c4 tiered (c3 drained); plain saves w5, w6 (path's retention 1
    removes c3); t7 tiered, not due (its draw read w6: the job saw it, recorded as held in path). Node 0
    replaced by a fresh machine (empty local_path): a tag-less resume loads t7 from node 1's copies (node 1's
    record must know w6; rank 0 alone recorded it, and the resume refused path as emptied)."""
    from torch import nn

    from smpckpt import FastTier, Retention

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    kept = Retention(num_kept_partial_checkpoints=1)
    fast = [FastTier(local_path=local, replicas=2, durable_every=3, num_kept_local=1), kept]
    torch.manual_seed(2)
    model = nn.Linear(4, 4)
    for tag in ("c1", "c2", "c3", "c4", "w5", "w6", "t7"):
        with torch.no_grad():
            model.weight.add_(1.0)
        if tag == "w5":
            wait_for_saves()  # c3's drain committed before path's retention runs (else c3 may stay: a flake, fix72k)
        save_checkpoint(durable, tag, model=model, options=fast if tag[0] != "w" else kept)
    wait_for_saves()
    dist.barrier()
    gathers = {k: _gathers(durable, local, **kw) for k, kw in (("tagless", {}), ("tag", {"tag": "t7"}))}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local)
        os.makedirs(local)
    dist.barrier()
    got = _resume_tagless(durable, local, model)
    return {"got": got, "path": sorted(os.listdir(durable)), "gathers": gathers}


def fresh_node0_after_a_path_resume(rank: int, base: str, durable: str) -> Any:
    """(test_tiers_path.py, rev72e LOW-3) c1 tiered, drained (every node records it); a plain save w2 (path's
    retention 1 removes c1); the job resumes w2 from path (every node's first rank records it: node 0's alone
    before abc0831) and saves x3 tiered with path down (its draw reads nothing). Node 0 replaced (empty
    local_path), path back: a tag-less resume loads x3 from node 1's copies, bit-exact (node 1's record must
    know w2, else path looks emptied)."""
    from torch import nn

    import smpckpt.api._fast_save as fast_save
    from smpckpt import Checkpointer, FastTier, Retention

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    fast = FastTier(local_path=local, replicas=2, durable_every=1, num_kept_local=1)
    torch.manual_seed(3)
    model = nn.Linear(4, 4)
    save_checkpoint(durable, "c1", model=model, options=fast)
    wait_for_saves()
    save_checkpoint(durable, "w2", model=model, options=Retention(num_kept_partial_checkpoints=1))
    wait_for_saves()
    real = fast_save.probe_checkpoint

    def down(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionRefusedError(111, "injected: path is down")

    with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c.resume(tag="w2", model=nn.Linear(4, 4))
        with torch.no_grad():
            model.weight.add_(1.0)
        fast_save.probe_checkpoint = down  # type: ignore[assignment]
        try:
            c.save("x3", model)
            c.wait()
        finally:
            fast_save.probe_checkpoint = real  # type: ignore[assignment]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local)
        os.makedirs(local)
    dist.barrier()
    return _resume_tagless(durable, local, model)


def _gathers(durable: str, local: str, **kw: Any) -> int:
    """The ``all_gather_object`` calls of a tiered resume (rev72b L1: a tag-less one gathered the nodes' drain
    records in one more, though the listings' gather reads each node's job folder already)."""
    from torch import nn

    from smpckpt import FastTier
    from smpckpt.api._dist import DistContext

    real, calls = DistContext.all_gather_object, []

    def counted(self: Any, obj: Any) -> Any:
        calls.append(obj)
        return real(self, obj)

    DistContext.all_gather_object = counted  # type: ignore[method-assign]
    try:
        resume_from_checkpoint(durable, model=nn.Linear(4, 4), options=FastTier(local_path=local), **kw)
    finally:
        DistContext.all_gather_object = real  # type: ignore[method-assign]
    return len(calls)
