#!/usr/bin/env python3
"""Fault injection: SIGKILL a save loop at many points and count the checkpoints lost (must be 0).

    python tests/fault_injection.py --kills 60 --seed 0 [--modes partial,full,tiered] [--root DIR] [--json out.json]

A child process (this script with ``--child``: one plain process, no process group) trains a tiny
model (a ``nn.Linear`` stack + Adam, ~3.3 MB of state) whose parameters and Adam state at step ``k``
are a pure function of ``k`` (filled from ``torch.Generator().manual_seed(k)``), and loops::

    save_checkpoint(root, f"step{k:05d}", model=..., optimizer=..., user_content={"step": k},
                    num_kept_partial_checkpoints=3)

appending (and fsyncing) one line to a progress file after every save that returned, so the parent
knows which tags were *reported committed*. Three save loops (``--modes``; kill points are spread over
them, each on a root of its own): ``partial`` (the loop above); ``full`` (each step also saved as a full
artifact ``full{k:05d}``: staging folder, boxes written at offsets, renamed into place); ``tiered``
(``local_path=`` a fast tier beside the root, ``replicas=1``, every 2nd save drained to the root in the
background: fast-tier node copies and drains). Every child run starts as a restart would: it resumes
(``newest``, fallback: newest committed tag), saves ``resumed step + 1`` (the restart save, no fault
armed), then arms its fault and goes on saving until it dies.

Kill points (``--kills N``: half of each, unless ``--kinds`` says otherwise):

* deterministic (``KINDS``): the child wraps a function of the commit sequence -- data-file sink
  writes/fsyncs (``smpckpt.storage.backends._sinks.LocalSink``), ``write_bytes_atomic`` of ``.metadata`` and
  the manifest commit (the writer's ``_write_manifest`` seam), ``os.replace``/``os.link`` publishing
  ``.metadata``/the manifest/``newest`` (before or after),
  ``os.fsync``, ``smpckpt.catalog.root.write_newest``, retention's ``remove_checkpoint`` (before it, and
  between the files it deletes), and the point after ``save_checkpoint`` returned but before the
  progress line -- so that its N-th call (N drawn by the parent from the seed and passed in the
  ``SMPCKPT_FI_FAULT`` environment variable) runs ``os.kill(os.getpid(), SIGKILL)``. Functions are
  replaced wherever they are looked up: the ``os`` module attribute, the class attribute, and every
  ``from x import y`` copy in a loaded ``smpckpt.*`` module (found by identity; the child reports
  where it patched). Only the child is patched; package files are never touched.
* ``timed``: the parent sends SIGKILL 0.05-2 s after the child finished its resume (its first
  progress line), so the kill lands anywhere in the restart save or the save loop.

A kill counts as *landed* only when the child really died of SIGKILL (and, for a deterministic kill,
after writing its "kill" marker). After every kill the parent checks, in-process with unpatched
imports:

(a) each of the last 3 reported-committed tags is still committed and passes ``verify_checkpoint``,
    unless retention legitimately deleted it (3 newer committed checkpoints exist);
(b) ``resume_from_checkpoint(root, model=fresh, optimizer=fresh)`` succeeds, loads a state bit-exactly
    equal (``torch.equal``, every parameter and Adam tensor) to the expected state of the step it
    reports (``user_content["step"]``), and that step is >= the newest reported one (a crash may lose
    only the save in progress) and was attempted by some save;
(c) the next child run resumes and saves on (its restart save succeeds). A failure of (c) -- e.g.
    ``CheckpointExists`` when a crash between the commit and the ``newest`` update makes the restart
    replay a committed tag -- is reported against the kill point that left the state behind; the
    remaining points then run on a fresh root (the failure is counted, not worked around).

Per mode: ``full`` also checks that every ``full*`` folder is a committed artifact that verifies (a
staged save is published only once committed) and that the last 3 reported full artifacts hold their
step's weights bit-exactly; ``tiered`` resumes with ``local_path`` (the newest complete copy of either
tier) and verifies every committed copy in both tiers (which saves were drained is not reported, so
(a) is replaced by (b)).

LOST = a reported-committed tag that should be kept is gone or unverifiable, or resume fails or
returns an older step than the newest reported one. Every other committed checkpoint is verified
too: a checksum/size problem is a failure ("corrupt"); a missing stock ``.metadata`` copy only (a
crash between the commit and that copy; smpckpt still loads it) is a warning ("no .metadata").
Leftovers (uncommitted folders, temp files, orphan files of dead saves inside committed folders) are
counted per kill (new paths only) and reported only.

Output: a table per kill kind, totals, warnings and failures with a reproduction, ``--json``; exit 1
if anything was lost, a resume or a restart failed, a committed checkpoint was corrupt, or a child
errored/hung. Every subprocess has a timeout. Children are pre-started (``--prefetch``) so their
torch import overlaps the previous run and the parent's checks.

Reproducing one deterministic point on a fresh root:
``python tests/fault_injection.py --kills 1 --seed S --kinds KIND --n N``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from fault_checks import Epoch, check_root, leftovers_of
from fault_child import child_main
from fault_common import (
    ALL_KINDS,
    DET_MAX_SAVES,
    FAULT_ENV,
    KEEP,
    KINDS,
    MODE_KINDS,
    MODES,
    READY_TIMEOUT_S,
    RUN_TIMEOUT_S,
    TIMED,
    TIMED_MAX_SAVES,
    TIMED_RANGE_S,
)


# -- parent: plan ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Point:
    index: int
    kind: str
    n: int | None = None  # deterministic kinds
    delay_s: float | None = None  # timed kills
    mode: str = "partial"  # the save loop killed (fault_common.MODES)

    def fault(self) -> dict[str, Any]:
        if self.kind in KINDS:
            return {"kind": self.kind, "n": self.n, "max_saves": DET_MAX_SAVES, "mode": self.mode}
        return {"kind": self.kind, "max_saves": TIMED_MAX_SAVES if self.kind == TIMED else 3, "mode": self.mode}

    @property
    def key(self) -> str:
        """Where its figures go in the report: kind per mode."""
        return f"{self.mode}:{self.kind}"

    def label(self) -> str:
        if self.kind in KINDS:
            return f"{self.mode}:{self.kind} N={self.n}"
        if self.kind == TIMED:
            return f"{self.mode}:timed {self.delay_s:.3f}s"
        return f"{self.mode}:{self.kind}"


def make_plan(kills: int, seed: int, kinds: list[str], force_n: int | None, modes: list[str]) -> list[Point]:
    rng = random.Random(seed)
    det = [(m, k) for m in modes for k in MODE_KINDS[m] if k in kinds]
    timed = TIMED in kinds
    n_timed = kills // 2 if (timed and det) else (kills if timed else 0)
    n_det = kills - n_timed
    det_seq: list[tuple[str, str]] = []
    while len(det_seq) < n_det:
        cycle = list(det)
        rng.shuffle(cycle)
        det_seq.extend(cycle)
    points = [
        Point(0, k, n=force_n if force_n is not None else rng.randint(*KINDS[k][2]), mode=m) for m, k in det_seq[:n_det]
    ]
    points += [
        Point(0, TIMED, delay_s=round(rng.uniform(*TIMED_RANGE_S), 3), mode=modes[i % len(modes)])
        for i in range(n_timed)
    ]
    rng.shuffle(points)
    for i, p in enumerate(points):
        p.index = i
    return points


# -- parent: children -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Child:
    point: Point
    proc: subprocess.Popen[bytes]
    log_path: str
    log_file: Any


def spawn(point: Point, state_dir: str, serial: int) -> Child:
    env = dict(os.environ)
    env[FAULT_ENV] = json.dumps(point.fault())
    log_path = os.path.join(state_dir, "logs", f"child{serial:03d}_{point.kind}.log")
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in discard()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log_file,
        env=env,
    )
    return Child(point, proc, log_path, log_file)


def discard(child: Child) -> None:
    try:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    child.log_file.close()
    for f in (child.proc.stdin, child.proc.stdout):
        try:
            if f:
                f.close()
        except OSError:
            pass


def wait_ready(child: Child, timeout: float) -> str | None:
    """None when the child printed "ready", else why not."""
    deadline = time.monotonic() + timeout
    fd = child.proc.stdout.fileno()  # type: ignore[union-attr]
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"not ready after {timeout:.0f}s"
        r, _, _ = select.select([fd], [], [], min(left, 1.0))
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                try:
                    rc: int | str | None = child.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    rc = "still running"
                return f"exited during start-up (rc={rc}); log {child.log_path}"
            buf += chunk
    return None if buf.split(b"\n", 1)[0].strip() == b"ready" else f"unexpected start-up output {buf[:200]!r}"


def read_events(path: str) -> list[dict[str, Any]]:
    events = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a torn last line
    except FileNotFoundError:
        pass
    return events


@dataclasses.dataclass
class RunResult:
    rc: int | None
    landed: bool
    timed_out: bool
    sent_kill: bool
    events: list[dict[str, Any]]
    wall_s: float
    startup_error: str | None = None
    ready_wait_s: float = 0.0

    def error(self) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == "error"), None)

    def restart_ok(self) -> bool:
        return any(e.get("event") == "committed" and e.get("phase") == "restart" for e in self.events)

    def committed_steps(self, event: str = "committed") -> list[int]:
        return [int(e["step"]) for e in self.events if e.get("event") == event]


def run_child(child: Child, root: str, progress_path: str) -> RunResult:
    point = child.point
    started = time.monotonic()
    why = wait_ready(child, READY_TIMEOUT_S)
    if why is not None:
        discard(child)
        return RunResult(child.proc.returncode, False, "not ready" in why, False, [], time.monotonic() - started, why)
    go = time.monotonic()
    ready_wait = go - started
    try:
        child.proc.stdin.write((json.dumps({"root": root, "progress": progress_path}) + "\n").encode())  # type: ignore[union-attr]
        child.proc.stdin.flush()  # type: ignore[union-attr]
        child.proc.stdin.close()  # type: ignore[union-attr]
    except OSError as exc:
        discard(child)
        return RunResult(child.proc.returncode, False, False, False, [], time.monotonic() - started, f"go: {exc}")
    sent = timed_out = False
    if point.kind == TIMED and point.delay_s is not None:
        # the delay counts from the end of the child's resume (its first progress line), so the kill
        # lands in the restart save or the save loop rather than in the read-only resume
        while child.proc.poll() is None and time.monotonic() - go < RUN_TIMEOUT_S:
            if read_events(progress_path):
                break
            time.sleep(0.005)
        try:
            child.proc.wait(timeout=point.delay_s)
        except subprocess.TimeoutExpired:
            child.proc.send_signal(signal.SIGKILL)
            sent = True
    try:
        child.proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - go)))
    except subprocess.TimeoutExpired:
        timed_out = True
        child.proc.kill()
        child.proc.wait(timeout=30)
    wall = time.monotonic() - go
    discard(child)
    events = read_events(progress_path)
    rc = child.proc.returncode
    killed = rc == -signal.SIGKILL and not timed_out
    if point.kind == TIMED:
        landed = killed and sent
    else:
        landed = killed and any(e.get("event") == "kill" for e in events)
    return RunResult(rc, landed, timed_out, sent, events, wall, ready_wait_s=ready_wait)


# -- parent: the campaign ---------------------------------------------------------------------------------
def zero_stats() -> dict[str, int]:
    return dict(
        points=0,
        landed=0,
        lost=0,
        resume_failures=0,
        restart_failures=0,
        corrupt_committed=0,
        no_stock_metadata=0,
        errors=0,
        leftover_dirs=0,
        leftover_files=0,
        leftover_bytes=0,
    )


def repro(args: argparse.Namespace, point: Point) -> str:
    me = "python tests/fault_injection.py"
    if point.kind in KINDS:
        return (
            f"{me} --kills 1 --seed {args.seed} --modes {point.mode} --kinds {point.kind} --n {point.n}  "
            f"(in the full run: --kills {args.kills} --seed {args.seed}, kill #{point.index})"
        )
    return (
        f"{me} --kills {args.kills} --seed {args.seed}  (kill #{point.index}, timed {point.delay_s}s; timing-dependent)"
    )


def campaign(args: argparse.Namespace, base: str) -> dict[str, Any]:
    t_start = time.monotonic()
    state_dir = os.path.join(base, "fi_state")
    os.makedirs(os.path.join(state_dir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(state_dir, "progress"), exist_ok=True)
    kinds = args.kinds.split(",") if args.kinds else list(ALL_KINDS)
    modes = args.modes.split(",") if args.modes else list(MODES)
    plan = make_plan(args.kills, args.seed, kinds, args.n, modes)
    # no fault: the restart check of the last kill of each save loop
    finals = [Point(len(plan) + i, "final", mode=m) for i, m in enumerate(dict.fromkeys(p.mode for p in plan))]
    todo = [*plan, *finals]

    serial = 0  # children started
    runs = 0  # children run
    queue: list[Child] = []

    def top_up(next_index: int) -> None:
        nonlocal serial
        while len(queue) < args.prefetch and next_index + len(queue) < len(todo):
            queue.append(spawn(todo[next_index + len(queue)], state_dir, serial))
            serial += 1

    top_up(0)
    import torch

    torch.set_num_threads(1)
    logging.getLogger("smpckpt").addHandler(logging.NullHandler())
    logging.getLogger("smpckpt").propagate = False

    # one root per save loop (a tiered root's fast tier beside it), a fresh one after a failed restart
    epochs_of: dict[str, list[Epoch]] = {m: [Epoch(0, os.path.join(base, f"{m}0"), mode=m)] for m in modes}
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    warnings_: list[dict[str, Any]] = []  # reported, not failing: see STOCK_ONLY
    by_kind: dict[str, dict[str, int]] = {k: zero_stats() for k in dict.fromkeys(p.key for p in plan)}
    calls_per_save: dict[str, int] = {}

    def fail(point: Point, what: str, detail: str, epoch: Epoch) -> None:
        failures.append(
            {
                "kill": point.index,
                "kind": point.kind,
                "n": point.n,
                "delay_s": point.delay_s,
                "what": what,
                "detail": detail,
                "root": epoch.root,
                "repro": repro(args, point),
            }
        )

    try:
        for i, point in enumerate(todo):
            rec: dict[str, Any] = {
                "kill": point.index,
                "kind": point.kind,
                "mode": point.mode,
                "n": point.n,
                "delay_s": point.delay_s,
            }
            retried = False
            epochs = epochs_of[point.mode]
            while True:
                epoch = epochs[-1]
                if queue and queue[0].point is point:
                    child = queue.pop(0)
                else:  # a retry on a fresh root: the pre-started child belongs to the next point
                    child = spawn(point, state_dir, serial)
                    serial += 1
                top_up(i + 1)
                runs += 1
                progress_path = os.path.join(state_dir, "progress", f"run{runs:03d}_kill{point.index:03d}.jsonl")
                result = run_child(child, epoch.root, progress_path)
                err = result.error()
                rec.update(
                    rc=result.rc,
                    landed=result.landed,
                    wall_s=round(result.wall_s, 3),
                    log=child.log_path,
                    progress=progress_path,
                    epoch=epoch.index,
                )
                if result.startup_error:
                    rec["error"] = f"child start-up: {result.startup_error}"
                elif result.timed_out:
                    rec["error"] = f"child hung (> {RUN_TIMEOUT_S:.0f}s); log {child.log_path}"
                elif err is not None:
                    rec["error"] = f"{err.get('phase')}: {err.get('type')}: {err.get('message')}"
                elif result.rc not in (0, -signal.SIGKILL):
                    rec["error"] = f"child exited with {result.rc}; log {child.log_path}"
                elif result.rc == -signal.SIGKILL and not result.landed:
                    rec["error"] = "child died of SIGKILL nobody planned (OOM?)"
                armed = next((e for e in result.events if e.get("event") == "armed"), None)
                if armed and armed.get("patched"):
                    rec["patched"] = armed["patched"]
                for a, b in zip(result.events, result.events[1:]):
                    if a.get("phase") == "loop" and b.get("phase") == "loop" and a.get("counts") and b.get("counts"):
                        for k, v in b["counts"].items():
                            calls_per_save.setdefault(k, v - a["counts"].get(k, 0))
                epoch.reported.extend(result.committed_steps())
                epoch.reported_full.extend(result.committed_steps("committed_full"))

                # (c) for the kill points that left this root's state behind
                restart_failed = err is not None and err.get("phase") in ("resume", "restart_save")
                if result.restart_ok():
                    epoch.pending.clear()
                elif restart_failed or (result.startup_error is None and result.timed_out and not result.restart_ok()):
                    detail = rec.get("error", "")
                    blamed = epoch.pending[-1] if epoch.pending else None
                    if blamed is not None:
                        bp = plan[blamed]
                        by_kind[bp.key]["restart_failures"] += 1
                        for r in records:
                            if r["kill"] == blamed:
                                r["restart"] = f"FAILED in the next run: {detail}"
                        fail(
                            bp,
                            "restart failed (c)",
                            detail
                            + (f" [earlier pending kills: {epoch.pending[:-1]}]" if len(epoch.pending) > 1 else ""),
                            epoch,
                        )
                        print(f"    !! restart after kill #{blamed} ({bp.label()}) FAILED: {detail[:300]}", flush=True)
                    else:
                        if point.key in by_kind:
                            by_kind[point.key]["errors"] += 1
                        fail(point, "restart save failed with no kill before it", detail, epoch)
                    # go on testing on a fresh root; retry this point there once
                    epochs.append(Epoch(len(epochs), os.path.join(base, f"{point.mode}{len(epochs)}"), mode=point.mode))
                    print(f"    -> continuing on a fresh root {epochs[-1].root}", flush=True)
                    if not retried:
                        retried = True
                        rec.pop("error", None)
                        continue
                break

            if point.kind == "final":
                rec["restart_check"] = "ok" if result.restart_ok() and not rec.get("error") else rec.get("error")
                if rec.get("error") and not restart_failed:
                    failures.append(
                        {
                            "kill": point.index,
                            "kind": "final",
                            "what": "final run failed",
                            "detail": rec["error"],
                            "root": epoch.root,
                            "repro": "",
                        }
                    )
                records.append(rec)
                continue

            stats = by_kind[point.key]
            stats["points"] += 1
            if result.landed:
                stats["landed"] += 1
                epoch.pending.append(point.index)
            if rec.get("error") and not restart_failed:
                stats["errors"] += 1
                fail(point, "child error", rec["error"], epoch)
            # the newest step any save of this root may have attempted: after each resume the restart
            # save attempts resumed + 1, the loop attempts one past each reported save
            for e in result.events:
                if e.get("event") in ("resumed", "committed") and e.get("step") is not None:
                    epoch.max_attempted = max(epoch.max_attempted, int(e["step"]) + 1)
            ran_up_to = epoch.max_attempted
            t_check = time.monotonic()
            check = check_root(epoch, ran_up_to)
            rec["check"] = check
            rec["ready_wait_s"] = round(result.ready_wait_s, 3)
            rec["check_s"] = round(time.monotonic() - t_check, 3)
            lost = len(check["lost"]) + (1 if not check["resume"].get("ok") else 0)
            stats["lost"] += lost
            stats["resume_failures"] += 0 if check["resume"].get("ok") else 1
            stats["corrupt_committed"] += len(check["corrupt"])
            stats["no_stock_metadata"] += len(check["stock_metadata_missing"])
            stats["leftover_dirs"] += check["leftovers"]["dirs"]
            stats["leftover_files"] += check["leftovers"]["files"]
            stats["leftover_bytes"] += check["leftovers"]["bytes"]
            for item in check["lost"]:
                fail(point, "lost checkpoint (a)", f"{item['tag']}: {item['why']}", epoch)
            if not check["resume"].get("ok"):
                fail(point, "resume failed (b)", str(check["resume"].get("why")), epoch)
            for item in check["corrupt"]:
                fail(
                    point,
                    "committed checkpoint fails verify_checkpoint (unreported: not counted as lost)",
                    f"{item['tag']}: {item['why']}",
                    epoch,
                )
            for item in check["stock_metadata_missing"]:
                warnings_.append(
                    {
                        "kill": point.index,
                        "kind": point.kind,
                        "n": point.n,
                        "delay_s": point.delay_s,
                        "what": "committed checkpoint without its stock .metadata copy: verify_checkpoint "
                        "warns (smpckpt loads it)",
                        "detail": f"{item['tag']}: {item['why']}",
                        "root": epoch.root,
                        "repro": repro(args, point),
                    }
                )
            records.append(rec)
            r = check["resume"]
            status = "landed" if result.landed else f"NOT landed (rc={result.rc})"
            print(
                f"[{point.index + 1:3d}/{len(plan)}] {point.label():24s} {status:18s} run {result.wall_s:5.2f}s "
                f"saves {len(result.committed_steps()):3d}  resume step {r.get('step')} "
                f"(reported {max(epoch.reported, default=None)}) {'ok' if r.get('ok') else 'FAIL: ' + str(r.get('why'))[:200]}"
                f"  lost {len(check['lost'])}  leftovers +{check['leftovers']['dirs']}d/+{check['leftovers']['files']}f"
                + (f"  ERROR {rec['error'][:200]}" if rec.get("error") else ""),
                flush=True,
            )
    finally:
        for c in queue:
            discard(c)

    totals = zero_stats()
    for s in by_kind.values():
        for k, v in s.items():
            totals[k] += v
    final_left = {"dirs": 0, "files": 0, "bytes": 0}
    all_epochs = [ep for eps in epochs_of.values() for ep in eps]
    for ep in all_epochs:
        files, dirs = leftovers_of(ep)
        final_left["dirs"] += len(dirs)
        final_left["files"] += len(files)
        final_left["bytes"] += sum(files.values())
    final_recs = [r for r in records if r["kind"] == "final"]
    final_check = "ok" if final_recs and all(r.get("restart_check") == "ok" for r in final_recs) else None
    if final_check is None and final_recs:
        final_check = "; ".join(f"{r['mode']}: {r.get('restart_check')}" for r in final_recs)
    ok = (
        totals["lost"] == 0
        and totals["resume_failures"] == 0
        and totals["restart_failures"] == 0
        and totals["corrupt_committed"] == 0
        and totals["errors"] == 0
        and not failures
    )
    return {
        "ok": ok,
        "seed": args.seed,
        "kills_requested": args.kills,
        "kinds": kinds,
        "keep": KEEP,
        "base": base,
        "modes": modes,
        "roots": [ep.root for ep in all_epochs],
        "runtime_s": round(time.monotonic() - t_start, 1),
        "by_kind": by_kind,
        "totals": totals,
        "final_restart_check": final_check,
        "final_leftovers_on_disk": final_left,
        "calls_per_save": calls_per_save,
        "failures": failures,
        "warnings": warnings_,
        "points": records,
    }


def print_report(rep: dict[str, Any]) -> None:
    cols = (
        "points",
        "landed",
        "lost",
        "resume_failures",
        "restart_failures",
        "corrupt_committed",
        "errors",
        "no_stock_metadata",
    )
    heads = (
        "points",
        "landed",
        "lost",
        "resume fail",
        "restart fail",
        "corrupt",
        "errors",
        "no .metadata",
        "leftovers",
    )
    w = max(16, *(len(k) for k in rep["by_kind"]))
    line = f"{'kind':{w}s} " + " ".join(f"{h:>12s}" for h in heads)
    print()
    print(line)
    print("-" * len(line))

    def row(name: str, s: dict[str, int]) -> None:
        left = f"{s['leftover_dirs']}d/{s['leftover_files']}f/{s['leftover_bytes'] / 2**20:.1f}M"
        print(f"{name:{w}s} " + " ".join(f"{s[c]:12d}" for c in cols) + f" {left:>12s}")

    for k in sorted(rep["by_kind"], key=lambda k: (k == TIMED, k)):
        row(k, rep["by_kind"][k])
    print("-" * len(line))
    row("TOTAL", rep["totals"])
    fl = rep["final_leftovers_on_disk"]
    print(
        f"\nleftovers (d: uncommitted folders, f: files no committed generation owns) created per kill above; "
        f"on disk at the end: {fl['dirs']} folder(s), {fl['files']} file(s), {fl['bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"final restart check: {rep['final_restart_check']};  roots used: {len(rep['roots'])};  "
        f"runtime {rep['runtime_s']} s"
    )
    _print_items(f"FAILURES ({len(rep['failures'])})", rep["failures"], 400)
    _print_items(
        f"WARNINGS ({len(rep['warnings'])}; not failures: nothing reported was lost, resume loads these)",
        rep["warnings"],
        300,
    )
    print("\nRESULT:", "OK (0 lost)" if rep["ok"] else "FAILED")


def _print_items(title: str, items: list[dict[str, Any]], width: int) -> None:
    """One line per failure or warning, with its kill point and a reproduction command."""
    if not items:
        return
    print(f"\n{title}:")
    for f in items:
        n = f" N={f['n']}" if f.get("n") is not None else ""
        delay = f" delay={f['delay_s']}s" if f.get("delay_s") is not None else ""
        print(f"  kill #{f['kill']} {f['kind']}{n}{delay}: {f['what']}: {f['detail'][:width]}")
        if f.get("repro"):
            print(f"      repro: {f['repro']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kills", type=int, default=60, help="kill points (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", help="work folder (created; must be empty); default: a temp folder, removed on success")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--kinds", help=f"comma-separated subset of: {','.join(ALL_KINDS)}")
    ap.add_argument("--modes", help=f"save loops killed, comma-separated subset of: {','.join(MODES)} (default: all)")
    ap.add_argument("--n", type=int, help="force N for deterministic kinds (reproduction)")
    ap.add_argument("--prefetch", type=int, default=2, help="children started ahead (overlaps torch import)")
    args = ap.parse_args(argv)
    if args.child:
        return child_main()
    if args.kills < 1 or args.prefetch < 1:
        ap.error("--kills and --prefetch must be >= 1")
    if args.kinds:
        bad = [k for k in args.kinds.split(",") if k not in ALL_KINDS]
        if bad:
            ap.error(f"unknown kinds {bad}; choose from {','.join(ALL_KINDS)}")
    if args.modes:
        bad = [m for m in args.modes.split(",") if m not in MODES]
        if bad:
            ap.error(f"unknown modes {bad}; choose from {','.join(MODES)}")
    if args.root:
        base = os.path.abspath(args.root)
        if os.path.exists(base) and os.listdir(base):
            ap.error(f"--root {base} is not empty")
        os.makedirs(base, exist_ok=True)
    else:
        base = tempfile.mkdtemp(prefix="smpckpt-fi-")
    rep = campaign(args, base)
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    if not args.root:
        if rep["ok"]:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"(kept {base} for inspection)")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
