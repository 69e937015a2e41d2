"""The fault-injection child: resumes, saves on with one fault armed, dies (see fault_injection.py)."""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from fault_common import (
    DET_MAX_SAVES,
    FAULT_ENV,
    KEEP,
    KINDS,
    MANIFEST,
    build_model,
    fill_state,
    full_tag_of,
    tag_of,
    tier_options,
)

_REAL_FSYNC = os.fsync  # the child's own progress file never goes through the patched fsync


# -- child ----------------------------------------------------------------------------------------------
class Progress:
    """Append-only JSON lines, fsynced (with the real fsync) after each line."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, sync: bool = True, **event: Any) -> None:
        event["t"] = round(time.monotonic(), 4)
        os.write(self.fd, (json.dumps(event) + "\n").encode())
        if sync:
            _REAL_FSYNC(self.fd)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


def _classify(path: Any) -> str:
    base = os.path.basename(os.fspath(path)) if path is not None else ""
    if base == MANIFEST:
        return "manifest"
    if base.startswith(".metadata"):
        return ".metadata"
    if base == "newest":
        return "newest"
    return "other"


class Injector:
    """Counts calls of the wrapped functions and SIGKILLs this process at the configured call."""

    def __init__(self, fault: dict[str, Any], progress: Progress) -> None:
        self.kind = fault.get("kind", "none")
        spec = KINDS.get(self.kind)
        self.counter, self.when, self.n = (spec[0], spec[1], int(fault["n"])) if spec else ("", "", 0)
        self.progress = progress
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.in_removal = 0
        self.patched: dict[str, list[str]] = {}

    # the decision ------------------------------------------------------------------------------------
    def _count(self, name: str) -> int:
        with self.lock:
            self.counts[name] += 1
            return self.counts[name]

    def _die(self, name: str, count: int, when: str) -> None:
        self.progress.emit(sync=False, event="kill", kind=self.kind, counter=name, n=count, when=when)
        _kill_self()

    def before(self, name: str) -> bool:
        """Count a call; kill now (``before``) or return True when the caller must tear the write."""
        c = self._count(name)
        if name == self.counter and c == self.n:
            if self.when == "before":
                self._die(name, c, "before")
            if self.when == "torn":
                return True
        return False

    def after(self, name: str) -> None:
        if name == self.counter and self.when == "after" and self.counts[name] == self.n:
            self._die(name, self.n, "after")

    # installing the wrappers ------------------------------------------------------------------------
    @staticmethod
    def _replace_everywhere(orig: Any, new: Any) -> list[str]:
        """Replace ``orig`` in every loaded smpckpt module that holds it (``from x import y`` copies)."""
        hits = []
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "smpckpt" or mod_name.startswith("smpckpt.")):
                continue
            for attr, val in list(vars(mod).items()):
                if val is orig:
                    setattr(mod, attr, new)
                    hits.append(f"{mod_name}.{attr}")
        return hits

    def install(self) -> dict[str, list[str]]:
        import smpckpt.catalog.root as tags
        import smpckpt.storage.backends._folder as folder_mod
        import smpckpt.storage.backends._folder as fsmod
        import smpckpt.storage.backends._nofollow as nofollow
        import smpckpt.storage.backends._sinks as sinks
        import smpckpt.storage.tools as tools
        from smpckpt.storage.write.writer import FsspecStorageWriter

        inj = self

        # data-file sinks (class attributes: every instance looks them up there)
        orig_write, orig_commit = sinks.LocalSink.write, sinks.LocalSink.commit

        def sink_write(sink: Any, data: memoryview) -> None:
            if inj.before("sink.write"):
                mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
                orig_write(sink, mv[: len(mv) // 2])
                inj._die("sink.write", inj.n, "torn")
            orig_write(sink, data)

        def sink_commit(sink: Any) -> None:
            inj.before("sink.commit")
            orig_commit(sink)

        sinks.LocalSink.write = sink_write  # type: ignore[method-assign]
        sinks.LocalSink.commit = sink_commit  # type: ignore[method-assign]
        self.patched["LocalSink"] = [
            "smpckpt.storage.backends._sinks.LocalSink.write",
            "smpckpt.storage.backends._sinks.LocalSink.commit",
        ]

        # the writer's commit seam (a class attribute)
        orig_commit_manifest = FsspecStorageWriter._write_manifest

        def write_manifest(writer: Any, *args: Any, **kwargs: Any) -> Any:
            inj.before("commit")
            out = orig_commit_manifest(writer, *args, **kwargs)
            inj.after("commit")
            return out

        FsspecStorageWriter._write_manifest = write_manifest  # type: ignore[method-assign]
        self.patched["FsspecStorageWriter"] = ["smpckpt.storage.write.writer.FsspecStorageWriter._write_manifest"]

        # the commit protocol's folder: files created (the generation's metadata, side files) or published
        # (the manifest, the stock .metadata copy), counted by the name they write (class attributes)
        orig_create, orig_publish = folder_mod.Folder.create, folder_mod.Folder.publish

        def create(folder: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            counter = f"write:{_classify(name)}"
            inj.before(counter)
            out = orig_create(folder, name, *args, **kwargs)
            inj.after(counter)
            return out

        def publish(folder: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            counter = f"write:{_classify(name)}"
            inj.before(counter)
            out = orig_publish(folder, name, *args, **kwargs)
            inj.after(counter)
            return out

        folder_mod.Folder.create = create  # type: ignore[method-assign]
        folder_mod.Folder.publish = publish  # type: ignore[method-assign]
        self.patched["Folder"] = ["smpckpt.storage.backends._folder.Folder.create", "Folder.publish"]

        # a full save's staging folder renamed into place (the commit of a full artifact on POSIX)
        orig_rename = nofollow.rename_noreplace

        def rename_noreplace(*args: Any, **kwargs: Any) -> Any:
            inj.before("publish:folder")
            out = orig_rename(*args, **kwargs)
            inj.after("publish:folder")
            return out

        nofollow.rename_noreplace = rename_noreplace  # type: ignore[assignment]
        self.patched["rename_noreplace"] = ["smpckpt.storage.backends._nofollow.rename_noreplace"]

        # write_bytes_atomic (newest): the definition and every imported copy
        orig_wba = fsmod.write_bytes_atomic

        def wba(*args: Any, **kwargs: Any) -> Any:
            path = args[1] if len(args) > 1 else kwargs.get("path")
            name = f"wba:{_classify(path)}"
            inj.before(name)
            out = orig_wba(*args, **kwargs)
            inj.after(name)
            return out

        self.patched["write_bytes_atomic"] = self._replace_everywhere(orig_wba, wba)

        orig_newest = tags.write_newest

        def write_newest(*args: Any, **kwargs: Any) -> Any:
            inj.before("write_newest")
            out = orig_newest(*args, **kwargs)
            inj.after("write_newest")
            return out

        self.patched["write_newest"] = self._replace_everywhere(orig_newest, write_newest)

        orig_remove = tools.remove_checkpoint

        def remove_checkpoint(*args: Any, **kwargs: Any) -> Any:
            inj.before("remove_checkpoint")
            inj.in_removal += 1
            try:
                return orig_remove(*args, **kwargs)
            finally:
                inj.in_removal -= 1

        self.patched["remove_checkpoint"] = self._replace_everywhere(orig_remove, remove_checkpoint)

        # os functions: module attributes (looked up at call time) and any smpckpt-held copies
        def os_wrap(fn_name: str, counter: Any) -> None:
            orig = getattr(os, fn_name)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                name = counter(args, kwargs)
                if name:
                    inj.before(name)
                out = orig(*args, **kwargs)
                if name:
                    inj.after(name)
                return out

            hits = self._replace_everywhere(orig, wrapped)
            setattr(os, fn_name, wrapped)
            self.patched[f"os.{fn_name}"] = [f"os.{fn_name}", *hits]

        def publish_counter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            dst = args[1] if len(args) > 1 else kwargs.get("dst")
            return f"publish:{_classify(dst)}"

        os_wrap("replace", publish_counter)  # write_bytes_atomic: temp + rename
        os_wrap("link", publish_counter)  # exclusive commit: temp + hard link
        os_wrap("fsync", lambda a, k: "fsync")
        os_wrap("pwrite", lambda a, k: "pwrite")  # a full artifact's boxes, written at their offsets
        for fn_name in ("unlink", "remove", "rmdir"):
            os_wrap(fn_name, lambda a, k: "rm_in_removal" if inj.in_removal else "")
        for name, hits in self.patched.items():
            if not hits:
                raise RuntimeError(f"fault injection: {name} is looked up nowhere the harness knows; update it")
        return self.patched


def child_main() -> int:
    fault = json.loads(os.environ.get(FAULT_ENV) or "{}")
    import torch

    torch.set_num_threads(1)
    import smpckpt

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    model, opt = build_model()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(2, 1)  # nothing more on the pipe the parent reads
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the parent went away or did not need this child
    go = json.loads(line)
    root, progress = go["root"], Progress(go["progress"])
    max_saves = int(fault.get("max_saves", DET_MAX_SAVES))
    mode = fault.get("mode", "partial")
    # tiered: every save to this root's fast tier, every 2nd drained to the root in the background
    tier = tier_options(root) if mode == "tiered" else {}
    tier_resume = {"local_path": tier["local_path"]} if tier else {}

    def save(k: int) -> None:
        smpckpt.save_checkpoint(
            root,
            tag_of(k),
            model=model,
            optimizer=opt,
            user_content={"step": k},
            num_kept_partial_checkpoints=KEEP,
            **tier,
        )

    def save_full(k: int) -> None:
        smpckpt.save_checkpoint(root, full_tag_of(k), partial=False, model=model, user_content={"step": k})

    phase = "resume"
    try:
        uc = smpckpt.resume_from_checkpoint(root, model=model, optimizer=opt, missing_ok=True, **tier_resume)
        info = smpckpt.last_resume_info() if uc is not None else None
        step = None if uc is None else int(uc["step"])
        progress.emit(
            event="resumed",
            step=step,
            tag=info.tag if info else None,
            fell_back=bool(info.fell_back) if info else False,
        )
        start = 0 if step is None else step + 1
        phase = "restart_save"
        fill_state(model, opt, start)
        save(start)
        progress.emit(event="committed", step=start, phase="restart")
        phase = "install"
        inj = Injector(fault, progress)
        patched = inj.install() if inj.kind in KINDS or inj.kind == "final" else {}  # final: counts only
        progress.emit(event="armed", kind=inj.kind, n=inj.n, patched=patched)
        phase = "loop"
        for k in range(start + 1, start + 1 + max_saves):
            fill_state(model, opt, k)
            save(k)
            inj.before("post_save")
            progress.emit(event="committed", step=k, phase="loop", counts=dict(inj.counts))
            if mode == "full":  # and the same step as a full artifact
                save_full(k)
                progress.emit(event="committed_full", step=k, phase="loop")
        smpckpt.wait_for_saves()  # a drain in flight
        progress.emit(event="done")
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 3
        progress.emit(
            event="error",
            phase=phase,
            type=type(exc).__name__,
            message=str(exc)[:4000],
            traceback=traceback.format_exc()[-6000:],
        )
        return 3
