"""Export a checkpoint to what stock tools read: one ``torch.save`` file, or a stock-DCP folder
(:func:`convert_checkpoint`, ``smpckpt convert``; what and why: the README's "Compatibility")."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from fsspec.spec import AbstractBufferedFile
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from smpckpt._checks import check_flag
from smpckpt.api._dist import (
    decode_user_content,
    describe_user_content,
    encode_user_content,
    quiet_no_dist,
    translate_dcp,
)
from smpckpt.catalog import highest_sequence
from smpckpt.catalog import root as catalog
from smpckpt.errors import CheckpointCorrupt
from smpckpt.model.layout import API_RECORD_V1, RESERVED, LayoutRecord
from smpckpt.planners import ObjectBytes
from smpckpt.planners._entries import decode_object
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, open_fs
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import translate_errors
from smpckpt.storage.backends._sinks import DEFAULT_PART_SIZE
from smpckpt.tools._tiers import resolve_checkpoint_url

__all__ = ["convert_checkpoint", "ConvertReport"]

log = logging.getLogger(__name__)

Target = Literal["torch_save", "dcp"]


class _RecordPlanner(DefaultSavePlanner):
    """Stock DCP's planner that writes an :class:`ObjectBytes` record as its bytes (a ``torch.save``
    stream stock ``dcp.load`` decodes), not pickled again."""

    def resolve_data(self, write_item: Any) -> Any:
        obj = self.lookup_object(write_item.index)
        return io.BytesIO(obj) if isinstance(obj, ObjectBytes) else super().resolve_data(write_item)


class ConvertReport(dict[str, Any]):
    """``{"tensors": n, "objects": n, "bytes": n, "reshaped": [keys], "out": url}``."""


def _check_declared_sizes(src: str, metadata: Any, reader: FsspecStorageReader, record: LayoutRecord | None) -> None:
    """Before allocating: the metadata's shapes are sizes, and a committed checkpoint declares no more
    tensor bytes than its files hold (a crafted shape must fail here, not as a raw RuntimeError from
    ``torch.empty``, or by allocating without bound). Tied keys share their bytes and do not count."""
    tied = set(record.tied) if record is not None else set()
    declared = 0
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        if any(not isinstance(n, int) or n < 0 for n in md.size):
            raise CheckpointCorrupt(f"{src}: {key!r} has shape {tuple(md.size)}")
        if key not in tied:
            declared += math.prod(md.size) * md.properties.dtype.itemsize
    stored = reader.manifest.total_bytes if reader.manifest is not None else None
    if stored is not None and declared > stored:
        raise CheckpointCorrupt(f"{src}: its metadata declares {declared} bytes of tensors but its files hold {stored}")


class _SinkFile(io.RawIOBase):
    """A create-only sink as the file ``torch.save`` writes to."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sink.write(view)
        return len(view)


def _save_file(fs: Any, path: str, state: dict[str, Any], *, overwrite: bool) -> None:
    """``torch.save(state)`` to ``path`` through the commit protocol's folder (storage/backends/_folder.py):
    on POSIX a create-only temporary linked into place (renamed over the old file with ``overwrite``),
    never through a link; on object stores a create-only upload (``overwrite``: one plain upload, which
    appears whole at its completion)."""
    parent, _, name = path.rstrip("/").rpartition("/")
    with Folder(fs, parent or "/", create=True, follow=True) as folder:
        if folder.local:
            fd, tmp = folder.open_temp(name)
            try:
                with open(fd, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                folder.link_temp(tmp, name, sync=True, replace=overwrite)
            finally:
                folder.remove([tmp])
            return
        if overwrite:
            # not ``with``: fsspec closes a file on an exception too, and an object store's close publishes
            # what was written (a Ctrl-C in torch.save left a truncated file in place of the old one on S3);
            # discard drops it (s3fs aborts the upload), and a file marked closed is not closed when collected.
            # close() inside: s3fs sends the last parts and completes the upload there (rev68c F2)
            out = fs.open(path, "wb")
            try:
                with translate_errors(path):
                    torch.save(state, out)
                    out.close()
            except BaseException:
                if isinstance(out, AbstractBufferedFile):  # memory:// replaced the old file at the open
                    with contextlib.suppress(Exception):
                        out.discard()
                    out.closed = True
                raise
            return
        sink = folder.sink(name, sync=True, part_size=DEFAULT_PART_SIZE, max_parts_in_flight=4)
        try:
            with io.BufferedWriter(_SinkFile(sink), buffer_size=8 << 20) as f:
                torch.save(state, f)
            sink.commit()
        except BaseException:
            sink.abort()
            raise


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: Target = "torch_save",
    keep_view_shapes: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    out_storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
) -> ConvertReport:
    """Read the checkpoint folder ``src`` (committed smpckpt or stock DCP; checksums verified; as on
    the command line, ``PATH/TAG`` names ``PATH/TAG_partial`` when that exists, refused when the full ``PATH/TAG`` exists
    too: ``PATH/TAG/`` names that one) and write it to ``out``
    as ``to`` says. Returns what was written."""
    if to not in ("torch_save", "dcp"):
        raise ValueError(f"to must be 'torch_save' or 'dcp', got {to!r}")
    for name, flag in (
        ("keep_view_shapes", keep_view_shapes),
        ("allow_pickle", allow_pickle),
        ("overwrite", overwrite),
    ):
        check_flag(name, flag)  # overwrite="False" replaced an existing OUT file (hunt73c F9)
    src = resolve_checkpoint_url(os.fspath(src), storage_options or {})
    reader = FsspecStorageReader(src, storage_options=storage_options, allow_pickle=allow_pickle)
    metadata = reader.read_metadata()
    record = LayoutRecord.from_metadata(metadata)
    _check_declared_sizes(os.fspath(src), metadata, reader, record)
    reader.reset()
    # DCP's own offline pattern (dcp_to_torch_save's, which takes only a FileSystemReader): the empty
    # planner rebuilds the state dict, nested as saved, from the metadata, and the stock loader fills it.
    # Both names are private to DCP (tests/test_convert.py pins them). Our reader has refused objects that
    # are not weights-only-safe unless allow_pickle; the planner decodes them weights-only too, once per blob.
    state: dict[str, Any] = {}
    planner = _EmptyStatePlanner(weights_only=not allow_pickle)
    try:
        with quiet_no_dist():
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:  # a BaseException: the CLI would print DCP's whole traceback
        raise translate_dcp(exc, f"reading {os.fspath(src)}") from exc
    flat, paths = planner.state_dict, planner.mappings  # the same tensors, by saved key
    manifest = reader.manifest
    if manifest is not None and manifest.extra.get("api") == API_RECORD_V1 and RESERVED.user_content in state:
        # smpckpt 0.1.0 wrapped user_content's torch.save bytes in a second pickle; the loader unpickled the
        # outer one (to those bytes): the inner one is decoded as a resume decodes it
        state[RESERVED.user_content] = decode_user_content(state[RESERVED.user_content], allow_pickle=allow_pickle)
    reshaped: list[str] = []
    if not keep_view_shapes and record is not None:
        for key, shape in record.original_shapes.items():
            value = flat.get(key)
            if isinstance(value, torch.Tensor) and math.prod(shape) == value.numel():
                *parents, last = paths[key]
                node: Any = state
                for step in parents:
                    node = node[step]
                node[last] = value.reshape(shape)
                reshaped.append(key)
    out_url = os.fspath(out)
    if to == "torch_save":
        fs, path = open_fs(out_url, out_storage_options)
        if fs.isdir(path):  # a move into it would leave the file inside, not at OUT
            raise IsADirectoryError(f"{out_url} is a folder; torch_save output is one file: name the file")
        if fs.exists(path) and not overwrite:
            raise FileExistsError(f"{out_url} exists; pass overwrite=True (--overwrite) to replace it")
        _save_file(fs, path, state, overwrite=overwrite)
    else:
        extra: dict[str, Any] = {}
        if RESERVED.user_content in state:  # one record, as a save writes it: stock DCP's planner would
            # flatten a dict into keys a resume does not know (``user_content.step``) and refuse them; the
            # manifest says whether it needs allow_pickle, so a resume refuses before loading anything
            content = state[RESERVED.user_content]
            data, weights_only = encode_user_content(content, stacklevel=2)
            state[RESERVED.user_content] = ObjectBytes(data.getbuffer())
            extra = describe_user_content(content, not weights_only)
        writer = FsspecStorageWriter(
            out_url,
            storage_options=out_storage_options,
            format="torch_save",
            overwrite=overwrite,
            manifest_extra=extra,
        )
        try:
            with quiet_no_dist():
                dcp.save(state, storage_writer=writer, planner=_RecordPlanner(), no_dist=True)
        except CheckpointException as exc:
            raise translate_dcp(exc, f"writing {out_url}") from exc
        _warn_in_numbered_root(out_url, out_storage_options)  # (once written: not before a refusal, rev69a L4)
    tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
    report = ConvertReport(
        tensors=len(tensors),
        objects=len(metadata.state_dict_metadata) - len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        reshaped=sorted(reshaped),
        out=out_url,
    )
    log.info(
        "converted %s -> %s (%s): %d tensors, %d objects", os.fspath(src), out_url, to, len(tensors), report["objects"]
    )
    return report


def _warn_in_numbered_root(out_url: str, storage_options: Mapping[str, Any] | None) -> None:
    """A ``{root}/{tag}_partial`` output beside numbered saves carries no sequence number (commit68 L2): the
    root's retention counts it oldest, so removes it first, and a ``newest`` naming it is passed over."""
    root, _, name = (out_url if "://" in out_url else os.path.abspath(out_url)).rstrip("/").rpartition("/")
    if not root or catalog.tag_of_partial_dirname(name) is None:
        return
    with contextlib.suppress(OSError, ValueError):  # an unreadable root: nothing to say (the write reports it)
        if highest_sequence(root, storage_options) > 0:
            warnings.warn(
                f"{out_url} is written into {root}, whose checkpoints are numbered by the saves that wrote them; "
                "a converted one has no number: that root's retention removes it first, a tag-less resume passes "
                "it over, and a save after resuming it by its tag takes every numbered save there for abandoned "
                f"(kept, never counted). Convert into a folder outside {root}",
                stacklevel=3,
            )


class _EmptyStatePlanner(_EmptyStateDictLoadPlanner):
    """DCP's offline planner, decoding each distinct small object once (its ``load_bytes`` would
    ``torch.load`` every one of an optimizer's 11 hyper-parameter objects a parameter)."""

    def __init__(self, *, weights_only: bool) -> None:
        super().__init__()
        self.weights_only = weights_only  # the reader checked them too, unless allow_pickle
        self._decoded: dict[bytes, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = decode_object(value, self._decoded, weights_only=self.weights_only)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
