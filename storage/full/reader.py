"""``FullArtifactReader``: DCP StorageReader of a full artifact of ours or a plain Hugging Face folder,
beside ``FsspecStorageReader`` (partial and stock DCP checkpoints) as DCP's ``HuggingFaceStorageReader``
is beside ``FileSystemReader``. ``FsspecStorageReader`` hands a folder it finds to be one of these to
this reader, so callers that do not know what a folder holds keep using it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.storage.backends._fs import confine, device_read_bytes, is_local
from smpckpt.storage.format import _names
from smpckpt.storage.format._reading import ReaderBase, ReadStats
from smpckpt.storage.format.manifest import Probe
from smpckpt.storage.full._commit import folder_names
from smpckpt.storage.full._read import FullSource
from smpckpt.storage.full._source import hf_folder_files

__all__ = ["FullArtifactReader", "opens"]

log = logging.getLogger(__name__)


def opens(found: Probe) -> bool:
    """Whether a folder of this state is this reader's to open: a committed full artifact, or a folder
    without a commit (a Hugging Face folder, or -- refused by :meth:`FullArtifactReader.metadata_from`
    -- an unfinished save)."""
    return found.state == "uncommitted" or (found.manifest is not None and found.manifest.kind == "full")


class FullArtifactReader(ReaderBase):
    """Read a full artifact of ours (verified against the check units its metadata lists) or a plain
    Hugging Face folder (``model.safetensors``, or an index and shards; no checksums: *unverified*).

    Call order inside ``dcp.load`` ("all" = every rank)::

        0) (all)         reset(checkpoint_id)            only when dcp.load gets checkpoint_id=
        1) (all)         read_metadata()                 manifest and the artifact's description, or the
                                                          Hugging Face headers: one whole chunk per tensor
        2) (all)         set_up_storage_reader(metadata, is_coordinator, ...)
        3) (all)         prepare_local_plan(plan)         unchanged
        4) (coordinator) prepare_global_plan(plans)       unchanged
        5) (all)         read_data(plan, planner)         exact boxes, each check unit they touch verified

    Args:
        path, storage_options, verify_checksums, allow_pickle: as for
            :class:`~smpckpt.storage.FsspecStorageReader`.
        translation: for a Hugging Face folder: present its tensors under our keys and layout
            (``smpckpt.hf.llama.TRANSLATION``), box by box, so each rank reads only its shards' bytes.
            Full artifacts of ours need none.
        hf_prefix: prepended to every key of a Hugging Face folder (``"model."`` to match a state dict
            that holds the model under ``"model"``, as :func:`smpckpt.resume_from_checkpoint` does).
    """

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self.source: FullSource | None = None

    def _read_metadata(self) -> Metadata:
        return self.metadata_from(self._probe())

    def metadata_from(self, found: Probe) -> Metadata:
        """The metadata of the folder ``found`` describes (already probed by ``FsspecStorageReader``):
        one whole chunk per tensor. Refuses a partial or stock DCP checkpoint and an unfinished save."""
        self.state = found.state
        self.source = FullSource(
            self.fs, self.path, self.url, verify=self.verify_checksums, allow_pickle=self.allow_pickle
        )
        if found.state == "uncommitted":
            hf_files = self._hf_files()
            if hf_files is None:
                raise CheckpointNotFound(
                    f"{self.url} holds an uncommitted (incomplete or failed) save: {found.detail}; refusing to load it"
                )
            confine(self.fs, self.path, hf_files, where=self.url)
            log.info("%s: Hugging Face folder (no manifest): loading without integrity checks", self.url)
            self.state = "huggingface"
            metadata = self.source.from_hf_folder(hf_files, translation=self.translation, prefix=self.hf_prefix)
        elif found.manifest is not None and found.manifest.kind == "full":
            metadata, _ = self._committed_metadata(found.manifest)
            self.source.from_description(metadata, {f.name: f for f in found.manifest.files})
        else:
            raise CheckpointError(
                f"{self.url} holds a {found.state} partial or stock DCP checkpoint, not a full artifact: read it "
                "with smpckpt.storage.FsspecStorageReader"
            )
        # every tensor is one whole row-major block: a planner may read it in another shape of its size
        data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        metadata.planner_data = {**data, _names.WHOLE_TENSORS: True}
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.source is None:
            raise CheckpointError("set_up_storage_reader() called before read_metadata()")
        self.source.live = metadata  # a planner may have reshaped an entry (see _names.WHOLE_TENSORS)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if self.source is None:
            raise CheckpointError("read_data() called before read_metadata()")
        device0 = device_read_bytes() if is_local(self.fs) else None
        self.source.read(plan, planner)
        device1 = device_read_bytes() if device0 is not None else None
        per_file = {n: (needed, read) for n, (needed, read) in self.source.file_stats.items()}
        needed, read = sum(n for n, _ in per_file.values()), sum(r for _, r in per_file.values())
        device = device1 - device0 if device0 is not None and device1 is not None else None
        self.last_read_stats = ReadStats(needed, read, self.source.requests, len(plan.items), per_file, device)

    def _hf_files(self) -> list[str] | None:
        """The safetensors files when the folder is a Hugging Face model, not a save of ours without its
        manifest: one in progress (its marker), a full checkpoint whose manifest is gone (a removal
        interrupted after deleting it, or lost; its ``.metadata.<id>`` generation file stays), or a
        folder marked for removal. Those are refused, never read without their checksums."""
        names = folder_names(self.fs, self.path)
        ours = {_names.WRITING_MARKER, _names.REMOVING_NAME}
        if names & ours or any(_names.is_smpckpt_file(n) for n in names):
            return None
        return hf_folder_files(self.fs, self.path)
