"""The fault-injection parent's checks after each kill: nothing reported lost, resume bit-exact, leftovers."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from fault_common import (
    KEEP,
    MANIFEST,
    POISON_STEP,
    STOCK_ONLY,
    build_model,
    fill_state,
    full_tag_of,
    model_mismatches,
    state_mismatches,
    step_of,
    tag_of,
    tier_options,
)


# -- parent: checks ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Epoch:
    index: int
    root: str
    reported: list[int] = dataclasses.field(default_factory=list)
    seen_leftovers: set[str] = dataclasses.field(default_factory=set)
    seen_unverifiable: set[tuple[str, str]] = dataclasses.field(default_factory=set)  # (tag, save id)
    max_attempted: int = 0  # newest step any save of this root may have attempted
    pending: list[int] = dataclasses.field(default_factory=list)  # kill points awaiting their restart check
    mode: str = "partial"  # the save loop (fault_common.MODES)
    reported_full: list[int] = dataclasses.field(default_factory=list)  # full artifacts reported committed

    @property
    def fast(self) -> str | None:
        """(tiered) the fast tier's folder."""
        return str(tier_options(self.root)["local_path"]) if self.mode == "tiered" else None


def _tree_files(folder: str) -> list[tuple[str, int]]:
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                out.append((p, os.lstat(p).st_size))
            except FileNotFoundError:
                pass
    return out


def _owned_names(manifest: Any) -> set[str]:
    """File names of a manifest's generation (a ``Manifest`` object or its JSON dict)."""
    if manifest is None:
        return set()
    if isinstance(manifest, dict):
        return {str(f.get("name")) for f in manifest.get("files") or []} | {
            str((manifest.get("metadata") or {}).get("name"))
        }
    return {str(f.name) for f in manifest.files} | {str(manifest.metadata.name)}


def _committed_full(folder: str) -> Any:
    """The manifest of a committed full artifact at ``folder`` (``None``: not one)."""
    from smpckpt.storage import probe_checkpoint

    try:
        found = probe_checkpoint(folder)
    except Exception:  # noqa: BLE001 - not a committed checkpoint
        return None
    return found.manifest if found.manifest is not None and found.manifest.kind == "full" else None


def leftovers(root: str, committed: dict[str, Any]) -> tuple[dict[str, int], set[str]]:
    """``{path: bytes}`` of files no committed generation owns, and the uncommitted folder paths."""
    files: dict[str, int] = {}
    dirs: set[str] = set()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return files, dirs
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            tag = entry.name[: -len("_partial")] if entry.name.endswith("_partial") else None
            rec = committed.get(tag) if tag else None
            staged = entry.name.startswith((".smpckpt-staging.", ".smpckpt-trash."))  # never a checkpoint
            if rec is None and tag is None and not staged and (full := _committed_full(entry.path)) is not None:
                rec = dataclasses.make_dataclass("Full", ["manifest"])(full)  # a committed full artifact
            if rec is None:
                dirs.add(entry.path)
                files.update(_tree_files(entry.path))
                continue
            owned = _owned_names(rec.manifest) | {".metadata", MANIFEST}
            for p, size in _tree_files(entry.path):
                if os.path.relpath(p, entry.path) not in owned:
                    files[p] = size
        elif entry.name != "newest":
            files[entry.path] = entry.stat(follow_symlinks=False).st_size
    return files, dirs


def leftovers_of(epoch: Epoch) -> tuple[dict[str, int], set[str]]:
    """:func:`leftovers` of the epoch's root and (tiered) of its fast tier."""
    from smpckpt.catalog.root import scan_root

    files: dict[str, int] = {}
    dirs: set[str] = set()
    for root in [epoch.root, *([epoch.fast] if epoch.fast else [])]:
        try:
            committed = {r.tag: r for r in scan_root(root) if r.committed}
        except Exception:  # noqa: BLE001
            committed = {}
        f, d = leftovers(root, committed)
        files.update(f)
        dirs |= d
    return files, dirs


def _save_id(rec: Any) -> str:
    m = rec.manifest
    if m is None:
        return ""
    return str(m.get("save_id", "")) if isinstance(m, dict) else str(getattr(m, "save_id", ""))


def check_root(epoch: Epoch, ran_up_to: int | None) -> dict[str, Any]:
    """(a) + (b) on the current state of ``epoch.root``; plus leftovers attributed to this kill."""
    import smpckpt
    from smpckpt.catalog.root import scan_root
    from smpckpt.storage import verify_checkpoint

    out: dict[str, Any] = {
        "lost": [],
        "corrupt": [],
        "stock_metadata_missing": [],
        "legit_deleted": [],
        "resume": {},
        "errors": [],
    }
    reported = sorted(set(epoch.reported))
    newest_reported = reported[-1] if reported else None
    committed: dict[str, Any] = {}
    try:
        for r in scan_root(epoch.root):
            if r.committed:
                committed[r.tag] = r
        if epoch.fast:  # every committed copy in the fast tier is checked too (tagged "fast:")
            for r in scan_root(epoch.fast):
                if r.committed:
                    committed[f"fast:{r.tag}"] = r
    except Exception as exc:  # noqa: BLE001 - the root cannot even be listed: every kept tag is lost
        out["errors"].append(f"scan_root: {type(exc).__name__}: {exc}")
        out["lost"] = [{"tag": tag_of(s), "why": "scan_root failed"} for s in reported[-KEEP:]]
    else:
        steps_on_disk = sorted(s for s in (step_of(t) for t in committed) if s is not None)
        for tag, rec in sorted(committed.items()):
            try:
                rep = verify_checkpoint(rec.url)
                if not rep.ok:
                    out["corrupt"].append({"tag": tag, "why": "; ".join(rep.problems[:5]), "id": _save_id(rec)})
                elif any(w.startswith(STOCK_ONLY) for w in rep.warnings):
                    out["corrupt"].append(
                        {"tag": tag, "why": "; ".join(rep.warnings[:5]), "id": _save_id(rec), "stock_only": True}
                    )
            except Exception as exc:  # noqa: BLE001
                out["corrupt"].append({"tag": tag, "why": f"{type(exc).__name__}: {exc}", "id": _save_id(rec)})
        corrupt = {c["tag"] for c in out["corrupt"] if not c.get("stock_only")}
        # (tiered: which saves were drained is not reported; the newest reported one must resume, (b))
        for s in reported[-KEEP:] if epoch.mode != "tiered" else []:
            t = tag_of(s)
            if t in committed and t not in corrupt:
                continue
            if t in corrupt:
                out["lost"].append({"tag": t, "why": "committed but verify_checkpoint failed"})
                continue
            newer = sum(1 for x in steps_on_disk if x > s)
            if newer >= KEEP:
                out["legit_deleted"].append(t)
            else:
                out["lost"].append({"tag": t, "why": f"gone (only {newer} newer committed checkpoint(s) exist)"})
        # committed checkpoints that fail verification and are not counted as lost above; each one
        # is counted once, by the check that first saw it
        fresh = [
            c
            for c in out["corrupt"]
            if step_of(c["tag"]) not in reported[-KEEP:] and (c["tag"], c["id"]) not in epoch.seen_unverifiable
        ]
        epoch.seen_unverifiable |= {(c["tag"], c["id"]) for c in out["corrupt"]}
        out["corrupt"] = [c for c in fresh if not c.get("stock_only")]
        out["stock_metadata_missing"] = [c for c in fresh if c.get("stock_only")]
        out["committed_on_disk"] = sorted(committed)

    out["lost"] += _check_full(epoch, out)

    # (b) resume into a fresh, poisoned model
    res: dict[str, Any] = {"ok": False}
    try:
        model, opt = build_model()
        fill_state(model, opt, POISON_STEP)
        tier = {"local_path": epoch.fast} if epoch.fast else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            uc = smpckpt.resume_from_checkpoint(epoch.root, model=model, optimizer=opt, missing_ok=not reported, **tier)
        if uc is None:
            res.update(step=None, ok=not reported, why=None if not reported else "nothing to resume")
        else:
            info = smpckpt.last_resume_info()
            step = int(uc["step"])
            res.update(step=step, tag=info.tag if info else None, fell_back=bool(info and info.fell_back))
            bad = state_mismatches(model, opt, step)
            if bad:
                res["why"] = f"state of step {step} differs bit-wise in {len(bad)} tensor(s): {bad[:4]}"
            elif info is not None and info.tag != tag_of(step):
                res["why"] = f"tag {info.tag} holds user_content step {step}"
            elif newest_reported is not None and step < newest_reported:
                res["why"] = f"resumed step {step} < newest reported committed step {newest_reported}"
                res["regressed"] = True
            elif ran_up_to is not None and step > ran_up_to:
                res["why"] = f"resumed step {step} was never saved (last attempted {ran_up_to})"
            else:
                res["ok"] = True
    except Exception as exc:  # noqa: BLE001
        res["why"] = f"{type(exc).__name__}: {exc}"
    out["resume"] = res

    # leftovers created by this kill (paths not seen at an earlier check of this root)
    files, dirs = leftovers_of(epoch)
    new_files = {p: b for p, b in files.items() if p not in epoch.seen_leftovers}
    new_dirs = {d for d in dirs if d not in epoch.seen_leftovers}
    epoch.seen_leftovers |= set(files) | dirs
    out["leftovers"] = {"dirs": len(new_dirs), "files": len(new_files), "bytes": sum(new_files.values())}
    return out


def _check_full(epoch: Epoch, out: dict[str, Any]) -> list[dict[str, str]]:
    """(mode "full") Every ``full*`` folder under the root is a committed artifact that verifies (a staged
    save is renamed into place only once committed: anything else is a failure), and each of the last
    ``KEEP`` reported full artifacts is there and holds its step's weights bit-exactly."""
    import smpckpt
    from smpckpt.storage import verify_checkpoint

    if epoch.mode != "full":
        return []
    lost: list[dict[str, str]] = []
    for entry in sorted(os.scandir(epoch.root), key=lambda e: e.name):
        if not entry.name.startswith("full") or not entry.is_dir(follow_symlinks=False):
            continue
        if _committed_full(entry.path) is None:
            out["corrupt"].append({"tag": entry.name, "why": "a full artifact's folder without a commit", "id": ""})
            continue
        rep = verify_checkpoint(entry.path)
        if not rep.ok:
            out["corrupt"].append({"tag": entry.name, "why": "; ".join(rep.problems[:5]), "id": ""})
    for step in sorted(set(epoch.reported_full))[-KEEP:]:
        tag = full_tag_of(step)
        model, _ = build_model()
        try:
            uc = smpckpt.resume_from_checkpoint(epoch.root, tag, partial=False, model=model)
        except Exception as exc:  # noqa: BLE001
            lost.append({"tag": tag, "why": f"reported committed, now {type(exc).__name__}: {exc}"})
            continue
        bad = model_mismatches(model, step)
        if uc != {"step": step} or bad:
            lost.append({"tag": tag, "why": f"holds user_content {uc}, {len(bad)} parameter(s) differ: {bad[:3]}"})
    return lost
