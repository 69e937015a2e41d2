"""Full (consolidated) mode, the coordinator's side: the folder cleared and a place to write taken
(POSIX: a staging folder; object stores: the in-progress marker), then at the commit the artifact's
records, the metadata loaders see (one chunk per tensor) and the commit itself (``storage/format/commit.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.model.layout import METADATA_KEY, LayoutRecord
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import is_local, join, ls_fresh, read_bytes_or_none
from smpckpt.storage.format import manifest as _names
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.commit import commit, publish_staged, remove_folder
from smpckpt.storage.format.manifest import DESCRIPTION_FQN, WRITING_MARKER, FileRecord, Manifest, probe
from smpckpt.storage.full._exchange import plan_exchanges
from smpckpt.storage.full._plan import plan_artifact
from smpckpt.storage.full._source import ArtifactLayout
from smpckpt.storage.full._units import BoxUnits, rows_of
from smpckpt.storage.full._write import ObjectResult, create_files
from smpckpt.storage.full.options import FullOptions

if TYPE_CHECKING:
    from smpckpt.storage.full.writer import FullArtifactWriter

__all__ = ["staging_path", "folder_names", "whole_tensor_metadata", "clear_for_full_save", "begin_full_save"]
__all__ += ["artifact_records", "commit_full", "warn_ties_held_apart"]

log = logging.getLogger(__name__)


#: how to give a full save a process group that moves CPU tensors (both algorithms send shard bytes)
_GLOO = (
    "pass FullArtifactWriter(process_group=dist.new_group(backend='gloo')), or init the default group with "
    "backend='cpu:gloo,cuda:nccl'"
)


def clear_for_full_save(fs: Any, path: str, url: str) -> None:
    """(coordinator, before planning a full save) Refuse a folder holding a committed checkpoint or foreign
    files; remove an unfinished full save's debris, whatever its state, so a killed save never blocks its
    tag. A stalled save cannot interfere: on POSIX it writes its own staging folder, on object stores it
    creates only what is absent, failing at its first write or at its commit."""
    found = probe(fs, path, list_when_empty=False)
    if found.state in ("committed", "legacy"):
        raise CheckpointExists(
            f"{url} already holds a {found.state} checkpoint; full artifacts have fixed file names and are "
            "never overwritten in place (even with overwrite=True): save under a new tag, or remove it first"
        )
    names = folder_names(fs, path)
    if not names:
        return
    if _names.MANIFEST_NAME in names:  # committed since the probe: it is a checkpoint now
        raise CheckpointExists(f"{url}: a save committed here while this full save was starting; refusing")
    if not _names.unfinished_full_save(names):
        # a partial save's data or metadata files (the folder has no manifest and no marker)
        if found.state == "uncommitted" or any(
            _names.is_smpckpt_file(str(p)[len(path) + 1 :]) for p in fs.find(path, maxdepth=2)
        ):
            raise CheckpointExists(
                f"{url} holds the files of an uncommitted partial save (no {_names.MANIFEST_NAME}): one running "
                "there, or one that failed or was killed. Save under a new tag, or remove them first (`smpckpt "
                "prune --uncommitted-older-than AGE` removes such folders once nothing has written for AGE)"
            )
        raise CheckpointExists(
            f"{url} holds files that are not an smpckpt save in progress (a Hugging Face model?); refusing "
            "to write a full artifact over them"
        )
    # debris of an unfinished save: all of it goes, or a stale model.safetensors beside a new index would
    # be what from_pretrained loads. Marked first, so a save committing here meanwhile is never removed
    log.warning("%s: removing %d file(s) of an unfinished full save before writing", url, len(names))
    failed = remove_folder(fs, path, url, uncommitted_only=True)
    if failed:
        raise CheckpointError(f"{url}: could not remove the unfinished save's files {failed[:5]}")
    if read_bytes_or_none(fs, join(path, _names.MANIFEST_NAME)) is not None:
        raise CheckpointExists(f"{url}: a save committed here while this full save was starting; refusing")


def staging_path(path: str, save_id: str) -> str:
    """(POSIX) Where a full save of ``path`` writes its artifact before the commit renames it into place."""
    parent = path.rstrip("/").rpartition("/")[0] or "/"
    return join(parent, _names.staging_name(save_id))


def begin_full_save(
    writer: FullArtifactWriter, plans: list[SavePlan], save_id: str
) -> tuple[list[SavePlan], ArtifactLayout]:
    """(coordinator, in ``writer.prepare_global_plan``) Clear the folder, lay the artifact out over the ranks'
    plans and take a place to write it (POSIX: a staging folder with every file created; object stores:
    the in-progress marker, create-only). The ranks' plans and the layout the commit checks."""
    fs, path, url, process_group = writer.fs, writer.path, writer.url, writer.process_group
    options, sync = writer.full, writer.sync_files
    clear_for_full_save(fs, path, url)
    record_json = (plans[0].planner_data or {}).get(METADATA_KEY) if plans else None
    original = LayoutRecord.from_json(record_json).original_shapes if record_json else {}
    extra_names = [_names.MANIFEST_NAME, WRITING_MARKER, "config.json", _names.generation_metadata_name(save_id)]
    gather = not is_local(fs)  # an object cannot be written at offsets by many ranks
    # both algorithms send shard bytes (CPU tensors) over the process group: gather needs it, swaps prefer it
    # (gloo; an NCCL-only group cannot send CPU tensors)
    cpu_group = len(plans) < 2 or (
        dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend(process_group)).lower()
    )
    if gather and not cpu_group:
        raise CheckpointError(
            f"{url}: a full save to an object store sends shard bytes (CPU tensors) to each file's owner rank "
            f"over the process group, and this one ({dist.get_backend(process_group)}) cannot: {_GLOO}"
        )
    out, layout = plan_artifact(plans, options, save_id, original, reserved_names=extra_names, gather=gather)
    if gather:
        # from here until the commit the folder is this save's, never an HF model
        with Folder(fs, path) as folder:
            try:
                folder.create(WRITING_MARKER, save_id.encode(), sync=sync)
            except FileExistsError as exc:
                raise CheckpointExists(
                    f"{url}: another full save started writing here at the same moment (its {WRITING_MARKER} was "
                    "created first); this one wrote nothing. Save under another tag, or retry once that save ended"
                ) from exc
        return out, layout
    if options.row_swap_below and not cpu_group and dist.is_available() and dist.is_initialized():
        # correct but slower (README); said by each full save it slows (no state kept between saves)
        log.warning(
            "full save: the process group (%s) cannot move CPU tensors, so column shards with short rows are "
            "written row by row instead of swapped into blocks (slower, same bytes); for the faster path %s",
            dist.get_backend(process_group),
            _GLOO,
        )
    elif options.row_swap_below and cpu_group and len(plans) >= 2 and dist.get_world_size(process_group) == len(plans):
        # swaps need a group that moves CPU tensors, one member per planning rank
        out = plan_exchanges(out, options.row_swap_below)
    with Folder(fs, staging_path(path, save_id), create=True) as staging:
        create_files(staging, layout.files, sync=sync)
    return out, layout


def artifact_records(
    folder: Folder, layout: ArtifactLayout, options: FullOptions, *, sync: bool
) -> tuple[list[FileRecord], dict[str, bytes]]:
    """(coordinator, at the commit) The artifact files' manifest records (their sizes checked by the
    commit's listing) and the side files the commit creates (shard index, ``config.json``) with theirs."""
    records: list[FileRecord] = []
    for f in layout.files:
        if sync and folder.local:
            folder.fsync(f.name)
        records.append(FileRecord(f.name, f.size, -1, (), (), checks="tensors"))
    side = dict(layout.indexes)
    # config.json's dtype: the floating-point dtype most model tensors are stored in
    model = [d for fqn, d in layout.dtypes.items() if (options.route(fqn) or ("",))[0] == "model"]
    counts = Counter(d for d in model if d.is_floating_point)
    cfg = options.hf_config_json(counts.most_common(1)[0][0] if counts else None)
    if cfg is not None:
        side["config.json"] = cfg
    for name, data in side.items():
        records.append(FileRecord(name, len(data), -1, (len(data),), (hash_bytes(data),)))
    return records, side


def whole_tensor_metadata(
    metadata: Metadata, layout: ArtifactLayout, results: list[list[WriteResult]]
) -> tuple[list[FileRecord], dict[str, list[BoxUnits]]]:
    """(coordinator, in ``finish``, under its ``gc_paused``) The object files' records, from all ranks' results;
    loaders see one chunk per tensor, in the stored dtype, described with its check units."""
    boxes: dict[str, list[BoxUnits]] = {}
    records: list[FileRecord] = []
    for rank, rank_results in enumerate(results):
        for wr in rank_results:
            if isinstance(wr.storage_data, ObjectResult):
                name, size, digest = wr.storage_data
                records.append(FileRecord(name, size, rank, (size,) if size else (), (digest,) if size else ()))
                continue
            art = layout.exprs[wr.index.fqn][0] if wr.index.fqn in layout.exprs else ""
            for box in wr.storage_data or ():
                boxes.setdefault(f"{art}/{box.key}", []).append(box)
    sdm = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = dataclasses.replace(md.properties, dtype=layout.dtypes.get(fqn, md.properties.dtype))
            md = TensorStorageMetadata(props, md.size, [ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)])
        sdm[fqn] = md
    metadata.state_dict_metadata = sdm
    description = layout.description({key: rows_of(bs) for key, bs in boxes.items()})
    metadata.storage_data = {MetadataIndex(DESCRIPTION_FQN): description}
    return records, boxes


def warn_ties_held_apart(
    folder: Folder, layout: ArtifactLayout, options: FullOptions, boxes: dict[str, list[BoxUnits]], url: str
) -> None:
    """(coordinator, at the commit) Warn, by name, where a tie ``config.json`` states
    (:meth:`FullOptions.config_ties`) has its two tensors held apart in the artifact with different values (a
    pipeline's last-stage head drifted from the embedding). Compared by the check units the ranks hashed as they
    wrote (no read) where both tensors were cut alike; else read back from the files, 64 MiB at a time. The
    config is written as given: its flag means more than this tie to some models (T5 scales its decoder's
    output by it; one flag unties every pair, heads left out of the artifact too)."""
    pairs, said, family = options.config_ties()
    found = []
    for head, embed in pairs.items():
        a, b = layout.tensors.get(f"model/{head}"), layout.tensors.get(f"model/{embed}")
        if a is None or b is None:  # one left out (tied in the model) or not in this artifact
            continue
        units = [{(*map(tuple, u[:3]),): u[3] for u in rows_of(boxes.get(f"model/{k}", []))} for k in (head, embed)]
        if a[3:] != b[3:]:  # a 4.x list names every tied key (RoBERTa's bias too): only the family's pairs tell
            where = f"in dtype or shape ({a[3]} {list(a[4])}, {b[3]} {list(b[4])})" if head in family else ""
        elif units[0].keys() == units[1].keys():
            where = next(
                (f"in the unit at {list(k[1])} of {list(k[0])}" for k, d in units[0].items() if units[1][k] != d), ""
            )
        else:  # split differently (vocab- vs hidden-parallel): their units cover other boxes
            where = _first_byte_apart(folder, a, b, f"{url}: {head!r} and {embed!r}")
        if where:
            found.append(f"{head!r} and {embed!r} differ {where}")
    if found:
        text = (
            f"{url}: {'; '.join(found)}, but the hf_config ties them (tie_word_embeddings): transformers 5 loads the "
            "two apart (with a warning of its own), 4.x ties them on load (one value for both). A pipeline's "
            "last-stage head drifted from the embedding (the two stages' gradients not all-reduced)?"
        )
        if not said:  # implied only (no tie_word_embeddings): transformers 5 may take the model as untied
            log.info("%s (the config implies the tie)", text)
        else:
            log.warning("%s", text)
            warnings.warn(text, stacklevel=2)


def _first_byte_apart(folder: Folder, a: tuple[Any, ...], b: tuple[Any, ...], what: str) -> str:
    """Where two written tensors of one dtype and shape (``ArtifactLayout.tensors`` rows) first differ, read
    back 64 MiB at a time; ``""`` when equal. A failed read is logged, not raised: this is only a check, and
    the artifact is complete."""
    size, step = math.prod(a[4]) * a[3].itemsize, 64 << 20
    read = [functools.partial(folder.fs.cat_file, folder.where(p[1])) for p in (a, b)]
    try:
        for i in range(0, size, step):
            j = min(i + step, size)
            x, y = read[0](start=a[2] + i, end=a[2] + j), read[1](start=b[2] + i, end=b[2] + j)
            if len(x) != len(y) or len(x) != j - i:  # cut short: the commit's size check names the file
                log.warning("%s not compared (read back %d and %d of %d bytes)", what, len(x), len(y), j - i)
                return ""
            if x != y:
                apart = torch.frombuffer(bytearray(x), dtype=torch.uint8) != torch.frombuffer(
                    bytearray(y), dtype=torch.uint8
                )
                return f"at element {(i + int(apart.nonzero()[0])) // a[3].itemsize} of {math.prod(a[4])} (row-major)"
    except Exception as exc:  # noqa: BLE001 - botocore's connection errors are no OSError: a check loses no export
        log.warning("%s not compared (reading them back failed: %s: %s)", what, type(exc).__name__, exc)
    return ""


def folder_names(fs: Any, path: str) -> set[str]:
    """Base names in a folder as the store holds them now (empty when it does not exist)."""
    try:
        entries = ls_fresh(fs, path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}


def commit_full(
    writer: FullArtifactWriter, manifest: Manifest, metadata: bytes, side: dict[str, bytes], folder: Folder
) -> None:
    """(coordinator, last step of a full save) The one commit protocol: on POSIX the staging folder renamed
    into place; on object stores the manifest created while the in-progress marker still names this save,
    the marker removed after (a failed request raises ``CommitUncertain``: it may still land)."""
    refused = "another save committed here while this full save was writing"
    args = (writer.url, manifest, manifest.to_bytes())
    done: dict[str, Any] = {"sync": writer.sync_files, "metadata": metadata, "side": side, "refused": refused}
    if not folder.local:
        commit(folder, *args, owner_marker=manifest.save_id, **done)
        return
    parent = folder.path.rstrip("/").rpartition("/")[0] or "/"
    target = writer.path.rstrip("/").rpartition("/")[2]
    with Folder(writer.fs, parent, follow=True) as root:
        publish_staged(root, _names.staging_name(manifest.save_id), target, *args, **done)
