"""``FsspecStorageReader``: DCP StorageReader for committed smpckpt checkpoints (manifest present) and
stock DCP checkpoints (``.metadata`` only, read as *legacy*: no checksums), full artifacts and Hugging
Face folders (through their ``FullSource``); an uncommitted save raises
:class:`~smpckpt.errors.CheckpointNotFound`. Which of these a folder holds is decided once, in
``read_metadata``. ``FullArtifactReader`` is the same reader refusing partial and stock checkpoints.

Reads: each item's byte range (a raw tensor: only its slice's bytes) is widened to whole checksum blocks
when verifying, sorted and coalesced (``_plan``), then read and verified by ``thread_count`` workers
(``_fetch``, in the order ``_run`` gives); the planner is called from the calling thread only. Large
contiguous raw slices whose destination is a contiguous CPU tensor of the saved dtype and shape are read
straight into it (``os.preadv`` or a streamed ranged GET); everything else goes through pooled buffers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from smpckpt._checks import check_flag, check_int
from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, not_plain, stored_integers
from smpckpt.model.translation import Translation
from smpckpt.storage.backends._fs import (
    FsspecLocation,
    confine,
    default_read_threads,
    is_local,
    join,
    read_bytes_or_none,
)
from smpckpt.storage.format import manifest as _names
from smpckpt.storage.format._columns import REQUEST_COST_BYTES
from smpckpt.storage.format._reading import ReadStats, device_read_bytes
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format._staging import MIN_STAGING_BYTES, STAGING_BYTES
from smpckpt.storage.format.commit import generation_gone
from smpckpt.storage.format.manifest import LOAD_ID_PREFIX, FileRecord, Manifest, Probe, probe
from smpckpt.storage.full._commit import folder_names
from smpckpt.storage.full._read import FullSource
from smpckpt.storage.full._source import hf_folder_files
from smpckpt.storage.read._fetch import reading, reads_into
from smpckpt.storage.read._plan import DIRECT_MIN_BYTES, ROW_GAP, Item, plan_reads, raw_item
from smpckpt.storage.read._run import ReadRun

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FsspecStorageReader", "ReadStats", "FullArtifactReader"]

#: quantized dtypes whose records (saved before they were refused) hold integers a plain tensor reads
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32})


log = logging.getLogger(__name__)


# default request size caps (see max_request_bytes)
LOCAL_REQUEST_BYTES = 32 << 20
REMOTE_REQUEST_BYTES = 64 << 20
#: the default cost of one more request on an object store (see request_cost_bytes): a ranged GET's first
#: byte takes about 10-20 ms, in which one connection streams about 1 MiB (an estimate, not measured on S3)
REMOTE_REQUEST_COST_BYTES = 1 << 20


class ReaderOptions(TypedDict, total=False):
    """The options both readers take (``FullArtifactReader`` only these), as ``**options``."""

    storage_options: Mapping[str, Any] | None
    verify_checksums: bool
    allow_pickle: bool
    translation: Translation | None
    hf_prefix: str
    request_cost_bytes: int | None
    thread_count: int | None


class FsspecStorageReader(FsspecLocation, StorageReader):
    """Read a checkpoint at ``path`` (any fsspec URL).

    ``read_metadata`` reads the manifest (the commit marker), then the metadata it names;
    ``prepare_local_plan`` sorts items by file and offset; ``read_data`` does ranged, coalesced, verified
    reads.

    Args:
        path: folder or URL.
        storage_options: fsspec filesystem options; kept across :meth:`reset`.
        verify_checksums: verify the checksum of every block a read touches (default). ``False``
            skips it (and reads only the exact bytes).
        allow_pickle: hand object values that need arbitrary code to load to the planner. Only for
            checkpoints you trust; by default they raise :class:`~smpckpt.errors.UnsafeCheckpoint`.
        thread_count: worker threads that read, verify and copy (default: 4; on local files at most
            the CPUs this rank may use, at least 2: :func:`~smpckpt.storage.backends._fs.default_read_threads`).
        reads_in_flight: how many of them may be inside a read at once (``None``: all of them).
            Fewer than ``thread_count`` starts reads in file order while the other workers verify:
            for devices that punish concurrent streams (``benchmarks/RESULTS.md``, "cold loads").
        max_request_bytes: coalesced requests stop growing at this size (``None``: 32 MiB on local
            filesystems, 64 MiB elsewhere: ``benchmarks/RESULTS.md``, "Read request size"); on object
            stores a column slice whose span is larger is read in requests of whole row groups of at most this.
        coalesce_gap: merge ranges separated by at most this many bytes (reading the gap); the rows of
            a column slice on local disk share requests when they are at most this many bytes apart, or
            less than a page (``_plan.ROW_GAP``).
        request_cost_bytes: what one more small read request costs, in bytes a device streams in the
            same time (``None``: 16 KiB on local filesystems, 1 MiB on object stores). A column slice
            whose rows are fewer bytes apart than this is read as sequential spans of whole rows, gaps
            included, its columns copied out; wider gaps read a request per row (on object stores, a
            verified untiled record's run widened to the blocks it touches, each checked; a full artifact's
            rows too). 0: a request per row always (fewest device bytes).
        translation, hf_prefix: for a plain Hugging Face folder: see :class:`~smpckpt.storage.FullArtifactReader`.
        staging_bytes: the cap on host memory a load into CUDA tensors stages through (default 128 MiB):
            reads are copied through pinned buffers of this many bytes in all to the device on a side
            stream (``storage/format/_staging.py``); CPU destinations are filled in place.

    Full artifacts and Hugging Face folders are read as :class:`~smpckpt.storage.FullArtifactReader` reads
    them (with ``thread_count`` and ``request_cost_bytes``; the other read options do not apply to them).
    """

    #: refuse partial and stock DCP checkpoints (:class:`FullArtifactReader`)
    _full_only = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        reads_in_flight: int | None = None,
        max_request_bytes: int | None = None,
        coalesce_gap: int = 0,
        staging_bytes: int = STAGING_BYTES,
        storage_options: Mapping[str, Any] | None = None,
        verify_checksums: bool = True,
        allow_pickle: bool = False,
        translation: Translation | None = None,
        hf_prefix: str = "",
        request_cost_bytes: int | None = None,
        thread_count: int | None = None,
    ) -> None:
        self.staging_bytes = check_int("staging_bytes", staging_bytes, minimum=MIN_STAGING_BYTES)
        self.reads_in_flight = check_int("reads_in_flight", reads_in_flight, minimum=1, optional=True)
        self.max_request_bytes = check_int("max_request_bytes", max_request_bytes, minimum=1, optional=True)
        self.coalesce_gap = check_int("coalesce_gap", coalesce_gap, minimum=0)
        # raw items at least this large are read straight into their destination when it allows
        self.direct_min_bytes = DIRECT_MIN_BYTES
        super().__init__()
        self._cost_asked = check_int("request_cost_bytes", request_cost_bytes, minimum=0, optional=True)
        self._threads_asked = check_int("thread_count", thread_count, minimum=1, optional=True)
        check_flag("verify_checksums", verify_checksums)
        check_flag("allow_pickle", allow_pickle)
        self._keep(storage_options)
        self.verify_checksums = verify_checksums
        self.allow_pickle = allow_pickle
        self.translation, self.hf_prefix = translation, hf_prefix  # for a plain Hugging Face folder
        self.last_read_stats: ReadStats | None = None
        self.reading = False  #: a read began: a load failing after it has filled some destinations in place
        #: the manifest rank 0 chose this checkpoint by: its parse is reused for the very bytes read (hunt66b r5)
        self.known: Manifest | None = None
        self._open(path)

    @property
    def thread_count(self) -> int:
        """Worker threads of a read: the count given, else :func:`default_read_threads` for this URL."""
        return self._threads_asked or default_read_threads(is_local(self.fs))

    @thread_count.setter
    def thread_count(self, value: int) -> None:
        self._threads_asked = check_int("thread_count", value, minimum=1)

    @property
    def request_cost_bytes(self) -> int:
        """The cost of one more read request: the one given, else the default for this URL's backend."""
        if self._cost_asked is not None:
            return int(self._cost_asked)
        return REQUEST_COST_BYTES if is_local(self.fs) else REMOTE_REQUEST_COST_BYTES

    @request_cost_bytes.setter
    def request_cost_bytes(self, value: int | None) -> None:
        # settable after construction, as before it became a per-backend default (rev71e L1)
        self._cost_asked = None if value is None else check_int("request_cost_bytes", value, minimum=0)

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self.manifest: Manifest | None = None
        self.state: str | None = None
        self.load_id = f"{LOAD_ID_PREFIX}{uuid.uuid4().hex}"  # tells our planner which reader it has
        self.metadata_error: Exception | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._tensors: dict[str, Any] = {}  # the metadata's entries by key, as set up (see _chunk_of)
        self._records: dict[str, FileRecord] = {}
        self._sizes: dict[str, int | None] = {}  # legacy checkpoints: data file sizes, one stat per file
        self._plain_names: set[str] = set()  # data file names already checked (thousands of items share a few)
        self._metadata_path = self.url  # where the metadata came from (named in errors about its records)
        self.source: FullSource | None = None  # a full artifact or Hugging Face folder: where its bytes are

    # -- StorageReader protocol (reset, checkpoint_id, validate_checkpoint_id: FsspecLocation) ---------
    def read_metadata(self, *args: Any, **_unused: Any) -> Metadata:
        """(all ranks) The manifest first: it is the commit marker; then the metadata it names.

        DCP replaces an exception raised here by an ``AssertionError`` carrying its message: the original is
        kept in :attr:`metadata_error`. (The keyword parameter is not named ``kwargs``: DCP would then retry a
        failed read with ``rank=``, reading and failing twice.)"""
        try:
            metadata = self._read_metadata()
        except Exception as exc:
            self.metadata_error = exc
            raise
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner``; returns a completed future.

        A failure is raised from here (as DCP's ``FileSystemReader`` does), not stored in the future: torch's
        ``Future`` holds it from C++, out of the collector's sight, which would pin the exception, its frames
        and the state dict until the process ends. The failure's frames are cleared, so the exception, wherever
        it is kept, holds no read buffers or destination views either."""
        self.reading = True
        try:
            self._read(plan, planner)
        except Exception as exc:
            _release_frames(exc)
            gone = self._gone() if isinstance(exc.__cause__, FileNotFoundError) else None
            if gone is not None:
                raise gone from exc
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _gone(self) -> CheckpointError | None:
        """(a file missing) The error saying what became of the committed generation this load read when
        another save replaced or removed it (no damage: a load again works); ``None`` when its manifest is
        still there, or it was damaged by hand."""
        if self.manifest is None:
            return None
        return generation_gone(self.fs, self.path, self.url, self.manifest, "load")

    def _read_metadata(self) -> Metadata:
        """The folder's format, decided once here (``self.source`` set: a full artifact or a folder without
        a commit; else ``self.manifest`` set: a partial checkpoint; else a stock DCP one)."""
        found = self._probe()
        if found.state == "uncommitted" or (found.manifest is not None and found.manifest.kind == "full"):
            return self._full_metadata(found)
        if self._full_only:
            raise CheckpointError(
                f"{self.url} holds a {found.state} partial or stock DCP checkpoint, not a full artifact: read it "
                "with smpckpt.storage.FsspecStorageReader"
            )
        if found.manifest is None:  # a stock (legacy) checkpoint
            log.info("%s: stock DCP checkpoint (no manifest): loading without integrity checks", self.url)
            self._metadata_path = join(self.path, _names.METADATA_NAME)
            return found.legacy_metadata
        metadata, self._metadata_path = self._committed_metadata(found.manifest)
        self._records = {f.name: f for f in found.manifest.files}
        return metadata

    def _probe(self) -> Probe:
        """The folder's state (``self.state``); a missing checkpoint raises."""
        found = probe(self.fs, self.path, known=self.known)
        self.state = found.state
        if found.state == "missing":
            raise CheckpointNotFound(f"no checkpoint at {self.url}" + (f" ({found.detail})" if found.detail else ""))
        return found

    def _committed_metadata(self, manifest: Manifest) -> tuple[Metadata, str]:
        """The metadata ``manifest`` names, checked against its size and checksum, and where it was."""
        md_path = join(self.path, manifest.metadata.name)
        data = read_bytes_or_none(self.fs, md_path)
        if data is None:
            self.manifest = manifest  # replaced or removed since its manifest was read (rev63d R2)?
            raise self._gone() or CheckpointCorrupt(f"{md_path}: metadata listed in the manifest is missing")
        if not manifest.metadata.matches(data):
            raise CheckpointCorrupt(
                f"{md_path}: size/checksum differ from the manifest ({len(data)} bytes, "
                f"manifest says {manifest.metadata.size})"
            )
        metadata = load_metadata(data, where=md_path)
        self.manifest = manifest
        return metadata, md_path

    def _full_metadata(self, found: Probe) -> Metadata:
        """A full artifact's or a Hugging Face folder's metadata: one whole chunk per tensor. Refuses an
        unfinished save."""
        self.source = FullSource(
            self.fs,
            self.path,
            self.url,
            verify=self.verify_checksums,
            allow_pickle=self.allow_pickle,
            request_cost=self.request_cost_bytes,
            threads=self.thread_count,
        )
        if found.manifest is None:
            # a save of ours without its manifest (in progress, manifest lost, or marked for removal) is never
            # read unverified; else the safetensors files of a Hugging Face model, if it is one
            names = folder_names(self.fs, self.path)
            ours = bool(names & {_names.WRITING_MARKER, _names.REMOVING_NAME}) or any(
                map(_names.is_smpckpt_file, names)
            )
            hf_files = None if ours else hf_folder_files(self.fs, self.path)
            if hf_files is None:
                raise CheckpointNotFound(self._refusal(found.detail, names, ours))
            confine(self.fs, self.path, hf_files, where=self.url)
            log.info("%s: Hugging Face folder (no manifest): loading without integrity checks", self.url)
            self.state = "huggingface"
            metadata = self.source.from_hf_folder(hf_files, translation=self.translation, prefix=self.hf_prefix)
        else:
            metadata, _ = self._committed_metadata(found.manifest)
            self.source.from_description(metadata, {f.name: f for f in found.manifest.files})
            if self.translation is not None and self.source.untranslated(self.hf_prefix):
                self.source.translate_untranslated(metadata, self.translation, self.hf_prefix)
        # every tensor is one whole row-major block: a planner may read it in another shape of its size
        data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        metadata.planner_data = {**data, _names.WHOLE_TENSORS: True}
        return metadata

    def _refusal(self, detail: str, names: set[str], ours: bool) -> str:
        """Why a folder with no manifest (base ``names``; ``ours``: a save of ours) is refused; a Hugging Face
        folder of ``torch.save`` weights is named as such, not as a failed save of ours."""
        bins = sorted(n for n in names if n.startswith("pytorch_model") and n.endswith((".bin", ".bin.index.json")))
        if bins and not ours:
            return (
                f"{self.url} is a Hugging Face folder of torch.save weights ({', '.join(bins[:2])}) without "
                "safetensors: only safetensors Hugging Face folders load without a manifest (re-save it with "
                "save_pretrained, which writes model.safetensors)"
            )
        return f"{self.url} holds an uncommitted (incomplete or failed) save: {detail}; refusing to load it"

    @gc_paused()
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.source is not None:
            self.source.live = metadata  # a planner may have reshaped an entry (see _names.WHOLE_TENSORS)
            return  # the artifact's own description says where every byte is
        if self._full_only:
            raise CheckpointError("set_up_storage_reader() called before read_metadata()")
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.url}: metadata has no storage_data")
        self.storage_data = metadata.storage_data
        # the entries as set up (a copy of the mapping: a planner replacing one later changes nothing
        # here); each read's chunk is found when planned (_chunk_of), not indexed for every chunk
        self._tensors = dict(metadata.state_dict_metadata)

    def _chunk_of(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The saved dtype and sizes of the chunk of ``index``'s key at its offsets: the chunk at the
        position ``index.index`` hints when its offsets agree, else the last one at those offsets. Looked up
        per read rather than indexing every chunk of the checkpoint on every rank."""
        md = self._tensors.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata) or index.offset is None:
            return None
        chunks, offsets, at = md.chunks, tuple(index.offset), index.index
        if at is None or not 0 <= at < len(chunks) or tuple(chunks[at].offsets) != offsets:
            at = next((i for i in reversed(range(len(chunks))) if tuple(chunks[i].offsets) == offsets), None)
            if at is None:
                return None
        # the chunk's own sizes (a torch.Size), not a copy per item: the copies, kept by the items until the
        # reads were delivered, set off young collections mid-read (tests/test_gc_pauses.py)
        sizes = chunks[at].sizes
        # a quantized record (saved before they were refused) holds its integers: read as those (rev69f F2)
        dtype = md.properties.dtype
        if dtype in _QUANTIZED:
            dtype = stored_integers(dtype) or dtype
        return dtype, sizes if isinstance(sizes, tuple) else tuple(sizes)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        def key(it: ReadItem) -> tuple[str, int]:
            info = self.storage_data.get(it.storage_index)
            # records are checked in _item (with a message naming the key); sorting must not fail first
            offset = getattr(info, "offset", 0)
            return (str(getattr(info, "relative_path", "")), offset if _is_int(offset) else -1)

        plan.items = sorted(plan.items, key=key)
        return plan

    # -- planning ---------------------------------------------------------------------------------
    def _item(self, req: ReadItem) -> Item:
        info = self.storage_data.get(req.storage_index)
        if not isinstance(info, _StorageInfo):
            raise CheckpointCorrupt(f"{self.url}: no storage record for {req.storage_index.fqn!r}")
        descriptors = tuple(info.transform_descriptors or ())
        raw = _names.RAW_DESCRIPTOR in descriptors
        unknown = [d for d in descriptors if d != _names.RAW_DESCRIPTOR]
        if unknown:
            raise CheckpointError(f"{req.storage_index.fqn!r}: unsupported stream transforms {unknown}")
        self._check_record(req.storage_index.fqn, info)
        if req.type == LoadItemType.TENSOR and raw:
            chunk = self._chunk_of(req.storage_index)
            if chunk is None:
                raise CheckpointCorrupt(f"{self.url}: no chunk metadata for {req.storage_index.fqn!r}")
            dtype, sizes = chunk
            return raw_item(req, info.relative_path, info.offset, info.length, dtype, sizes)
        return Item(req, info.relative_path, info.offset, info.offset + info.length, False)

    def _check_record(self, fqn: str, info: _StorageInfo) -> None:
        """(calling thread, before any byte is read) The record names a plain file in the folder (listed
        in the manifest when there is one) and a byte range inside it. Crafted metadata (``../``, negative
        offsets, huge lengths) fails here with a :class:`CheckpointCorrupt` naming the file and the key."""
        name = getattr(info, "relative_path", None)  # DCP drops None fields when pickling a record
        if not (isinstance(name, str) and name in self._plain_names):
            name = _names.check_member_name(name, where=f"{self._metadata_path} (key {fqn!r})")
            self._plain_names.add(name)
        path = join(self.path, name)
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0):
            raise CheckpointCorrupt(
                f"{path}: key {fqn!r} is recorded at offset {offset!r} with length {length!r}; both must be "
                f"non-negative integers (the metadata {self._metadata_path} is corrupt or crafted)"
            )
        if self.manifest is not None:
            rec = self._records.get(name)
            if rec is None:
                raise CheckpointCorrupt(
                    f"{path}: data file of key {fqn!r} is not listed in the manifest (the metadata "
                    f"{self._metadata_path} is corrupt or crafted)"
                )
            size: int | None = rec.size
        else:
            size = self._legacy_size(name, fqn)
        if size is not None and offset + length > size:
            raise CheckpointCorrupt(
                f"{path}: key {fqn!r} is recorded at offset {offset} with length {length}, past the end of the "
                f"file ({size} bytes; the metadata is corrupt or crafted, or the file is truncated)"
            )

    def _legacy_size(self, name: str, fqn: str) -> int | None:
        """Size of a stock checkpoint's data file (``None`` where the backend cannot tell), stat'ed once."""
        if name not in self._sizes:
            path = join(self.path, name)
            with reading(path, [fqn]):
                size = self.fs.size(path)
            self._sizes[name] = int(size) if size is not None else None
        return self._sizes[name]

    # -- reading ---------------------------------------------------------------------------------
    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """(calling thread) Plan every item's byte range (every record checked before any byte is read),
        then read, verify and deliver them; buffers live only for this call."""
        if self._full_only and self.source is None:
            raise CheckpointError("read_data() called before read_metadata()")
        if not hasattr(planner, "loads_weights_only"):  # DCP's own planner: it checks no destination
            _refuse_destinations_not_plain(plan, planner)
        local = is_local(self.fs)
        if self.source is not None:
            source = self.source
            device = _device_bytes_during(local, lambda: source.read(plan, planner))
            per_file = {n: (needed, read) for n, (needed, read) in source.file_stats.items()}
            requests = source.requests
        else:
            max_request = self.max_request_bytes or (LOCAL_REQUEST_BYTES if local else REMOTE_REQUEST_BYTES)
            # objects per item; no I/O with a manifest (a stock checkpoint's files are stat'ed: not paused)
            with gc_paused() if self.manifest is not None else contextlib.nullcontext():
                reads = plan_reads(
                    [self._item(req) for req in plan.items],
                    self._records,
                    verify=self.verify_checksums,
                    local=local,
                    direct=reads_into(self.fs),
                    direct_min_bytes=self.direct_min_bytes,
                    coalesce_gap=self.coalesce_gap,
                    max_request_bytes=max_request,
                    row_gap=max(self.coalesce_gap, ROW_GAP),
                    request_cost=self.request_cost_bytes,
                )
            run = ReadRun(self, planner, max_request)
            device = _device_bytes_during(local, lambda: run.run(reads))
            per_file = {
                n: (reads.needed_per_file.get(n, 0), run.read_per_file.get(n, 0))
                for n in sorted(set(reads.needed_per_file) | set(run.read_per_file))
            }
            requests = run.requests
        needed, read = sum(n for n, _ in per_file.values()), sum(r for _, r in per_file.values())
        self.last_read_stats = ReadStats(needed, read, requests, len(plan.items), per_file, device)


class FullArtifactReader(FsspecStorageReader):
    """Read a full artifact of ours (verified against the check units its metadata lists) or a plain
    Hugging Face folder (``model.safetensors``, or an index and shards; no checksums: *unverified*);
    refuses a partial or stock DCP checkpoint.

    ``read_metadata`` gives one whole chunk per tensor; the plans pass unchanged; ``read_data`` reads
    exact boxes, verifying each check unit they touch.

    Args:
        path, storage_options, verify_checksums, allow_pickle, request_cost_bytes, thread_count: as for
            :class:`~smpckpt.storage.FsspecStorageReader`.
        translation: for a Hugging Face folder: present its tensors under our keys and layout
            (``smpckpt.hf.llama.TRANSLATION``), box by box, so each rank reads only its shards' bytes.
        hf_prefix: prepended to every key of a Hugging Face folder (``"model."`` to match a state dict
            that holds the model under ``"model"``, as :func:`smpckpt.resume_from_checkpoint` does).
    """

    _full_only = True

    def __init__(self, path: str | os.PathLike[str], **options: Unpack[ReaderOptions]) -> None:
        super().__init__(path, **options)


def _device_bytes_during(local: bool, read: Callable[[], None]) -> int | None:
    """Bytes the kernel read from block devices while ``read`` ran (``None``: not local, or not reported)."""
    before = device_read_bytes() if local else None
    read()
    after = device_read_bytes() if before is not None else None
    return after - before if before is not None and after is not None else None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _release_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame ``exc`` (and the exceptions chained to it) went through:
    read buffers, destination views and plans would otherwise live as long as the exception."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running (the caller's)
        todo += [e.__cause__, e.__context__]


def _refuse_destinations_not_plain(plan: LoadPlan, planner: LoadPlanner) -> None:
    """(a planner that is not ours) A quantized, nested or sparse destination, refused by key as ours refuses
    it: a copy into a quantized one keeps its own scale and zero-point (other values, silently)."""
    state = getattr(planner, "state_dict", None)  # DefaultLoadPlanner's (flattened); read, not resolved twice
    if not isinstance(state, Mapping):
        return
    for req in plan.items:
        if req.type == LoadItemType.TENSOR:
            t = state.get(req.dest_index.fqn)
            if isinstance(t, torch.Tensor) and (t.layout is not torch.strided or t.is_quantized or t.is_nested):
                raise not_plain(req.dest_index.fqn, t)
