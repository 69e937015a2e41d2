"""What the fast tier's save and resume share: nodes from ``LOCAL_WORLD_SIZE``, every node's folder
scanned and gathered, which tags the surviving folders hold completely, and the save counter that
``durable_every`` divides.

A tag is *committed in the fast tier* when some node's copy has its manifest: a node commits only
after every node held its share (``smpckpt.storage.tier.writer``). It is *complete* when the files
of the surviving folders, at the manifest's sizes, cover the manifest (data files and metadata).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from smpckpt.api._dist import DistContext
from smpckpt.catalog.listing import record_order, scan_root
from smpckpt.catalog.tags import list_partial_tags, open_root, partial_dirname
from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import Manifest
from smpckpt.storage.backends._fs import file_sizes, join, read_bytes_or_none
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format._names import MANIFEST_NAME
from smpckpt.storage.format.commit import remove_folder

__all__ = [
    "Nodes",
    "LocalCopy",
    "FastCandidate",
    "node_layout",
    "scan_local",
    "gather_views",
    "committed_copies",
    "fast_candidate",
    "assess",
    "part_sizes",
    "newest_complete",
    "tier_seq",
    "durable_seq",
    "note_durable_seq",
    "retain_local",
]

log = logging.getLogger("smpckpt.api")

#: the manifest ``extra`` entry a tiered save adds: {"seq", "durable", "replicas", "nodes", "local_world_size"}
TIER_KEY = "tier"

# durable root -> the highest save number committed there (read once per process, then kept current)
_DURABLE_SEQ: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This job's nodes: global rank ``r`` is on node ``r // local_world_size``."""

    local_world_size: int
    world_size: int
    rank: int

    @property
    def count(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def ranks_of(self, node: int) -> range:
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    @property
    def is_leader(self) -> bool:
        """This rank commits, heals and prunes its node's folder."""
        return self.rank % self.local_world_size == 0

    def replica_nodes(self, node: int, replicas: int) -> list[int]:
        """The nodes whose ranks' files ``node`` holds: itself and the ``replicas - 1`` before it (ring)."""
        return [(node - hop) % self.count for hop in range(replicas)]


def node_layout(ctx: DistContext, process_group: Any, replicas: int = 1) -> Nodes:
    """(all ranks) The nodes from torchrun's ``LOCAL_WORLD_SIZE``; refuses what cannot be tiered."""
    if not ctx.active or ctx.world_size == 1:
        lws = 1
    else:
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError(
                "local_path needs a process group of every rank (tiered checkpoints place replicas by node); "
                "pass process_group=None"
            )
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None or not raw.isdigit() or int(raw) < 1:
            raise ValueError(
                f"local_path needs LOCAL_WORLD_SIZE (ranks per node; torchrun sets it), got {raw!r}: ranks "
                "r with equal r // LOCAL_WORLD_SIZE share a node and its fast tier"
            )
        lws = int(raw)
        if ctx.world_size % lws:
            raise ValueError(f"world size {ctx.world_size} is not a multiple of LOCAL_WORLD_SIZE={lws}")
    nodes = Nodes(lws, ctx.world_size, dist.get_rank() if ctx.active else 0)
    if replicas > nodes.count:
        raise ValueError(
            f"replicas={replicas} needs {replicas} nodes, this job has {nodes.count} (world size {ctx.world_size}, "
            f"LOCAL_WORLD_SIZE={lws}): pass replicas={nodes.count} or fewer"
        )
    return nodes


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """One tag's folder in one node's fast tier, as its first rank saw it: its manifest's digest and
    save order (``digest`` ``None``: not committed there), its save number, every file (name -> size).
    Manifests themselves do not travel in the listing: at 1 TiB one is ~20 MiB, and every node has one."""

    digest: int | None
    order: tuple[int, int, str]
    seq: int
    files: Mapping[str, int]


def scan_local(local_path: str) -> dict[str, LocalCopy]:
    """(a node's first rank) Every ``{tag}_partial`` folder in this node's fast tier."""
    if not os.path.isdir(local_path):
        return {}
    fs, root = open_root(local_path)
    out = {}
    for tag, name in list_partial_tags(fs, root).items():
        folder = join(root, name)
        try:
            data = read_bytes_or_none(fs, join(folder, MANIFEST_NAME))
            files = file_sizes(fs, folder)
        except OSError as exc:  # a folder being removed: not a copy
            log.warning("fast tier %s: %s could not be read (%s); skipped", local_path, name, exc)
            continue
        manifest = None
        if data is not None:
            try:
                manifest = Manifest.from_bytes(data, where=join(folder, MANIFEST_NAME))
            except CheckpointCorrupt as exc:
                log.warning("fast tier: %s; that copy is not used", exc)
        digest = hash_bytes(data or b"") if manifest is not None else None
        out[tag] = LocalCopy(digest, record_order(manifest), seq_of(manifest), files)  # (0, 0, ""), 0 without one
    return out


def gather_views(ctx: DistContext, nodes: Nodes, mine: str) -> list[dict[str, LocalCopy]]:
    """(all ranks) Every node's fast tier as its first rank listed it, by rank (a node's ranks share
    its listing); refuses ranks of one node that name different folders (they would write one node's
    share twice, or not at all) and ranks that disagree on ``LOCAL_WORLD_SIZE``. ``mine``: this node's
    folder, as :func:`~smpckpt.api.options.check_local_path` returns it."""
    got = ctx.all_gather_object((mine, nodes.local_world_size, scan_local(mine) if nodes.is_leader else None))
    sizes = sorted({lws for _, lws, _ in got})
    if len(sizes) > 1:
        raise ValueError(f"LOCAL_WORLD_SIZE differs between ranks ({sizes}); every rank must see the same")
    views = []
    for rank, (path, _, _) in enumerate(got):
        leader = nodes.ranks_of(nodes.node_of(rank))[0]
        if path != got[leader][0]:
            raise ValueError(
                f"local_path differs between ranks of node {nodes.node_of(rank)}: rank {leader} passes "
                f"{got[leader][0]!r}, rank {rank} {path!r}; every rank of a node passes its node's folder"
            )
        views.append(got[leader][2] or {})
    return views


@dataclasses.dataclass(frozen=True)
class FastCandidate:
    """A tag committed in the fast tier: its manifest, who holds each of its parts, what none holds."""

    tag: str
    manifest: bytes
    order: tuple[int, int, str]
    held_by: Mapping[str, tuple[int, ...]]  #: part name -> ranks whose node folder holds it
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing

    def parsed(self) -> Manifest:
        return Manifest.from_bytes(self.manifest, where=f"fast-tier manifest of {self.tag!r}")


def seq_of(manifest: Manifest | None) -> int:
    tier = manifest.extra.get(TIER_KEY) if manifest is not None else None
    seq = tier.get("seq") if isinstance(tier, Mapping) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else 0


def committed_copies(views: Sequence[Mapping[str, LocalCopy]], tag: str | None = None) -> list[tuple[str, int]]:
    """Every (tag, manifest digest) some node committed (only ``tag``'s when given), newest first."""
    seen: dict[tuple[str, int], tuple[int, int, str]] = {}
    for view in views:
        for t, copy in view.items():
            if copy.digest is not None and (tag is None or t == tag):
                seen[(t, copy.digest)] = copy.order
    return sorted(seen, key=lambda k: (seen[k], k[0]), reverse=True)


def fast_candidate(
    ctx: DistContext, local_path: str, views: Sequence[Mapping[str, LocalCopy]], tag: str, digest: int
) -> FastCandidate | None:
    """(all ranks, one broadcast) The committed copy ``(tag, digest)``: its manifest from the first rank
    holding it, and its completeness across ``views`` (the same answer on every rank)."""
    holders = [r for r, v in enumerate(views) if tag in v and v[tag].digest == digest]
    data = None
    if ctx.rank == holders[0]:
        data = read_bytes_or_none(open_root(local_path)[0], join(join(local_path, partial_dirname(tag)), MANIFEST_NAME))
    data = ctx.broadcast_object(data, src=holders[0])
    if data is None or hash_bytes(data) != digest:
        return None  # removed since the listing (retention of another job's process?): not a candidate
    return assess(tag, data, holders, [v[tag].files if tag in v else None for v in views])


def assess(tag: str, data: bytes, holders: Sequence[int], files: Sequence[Mapping[str, int] | None]) -> FastCandidate:
    """The committed copy ``data`` (manifest bytes) of ``tag`` across folders: ``files[i]`` is what folder
    ``i`` holds of the tag (``None``: nothing), ``holders`` the folders holding this manifest. A part is
    held where a folder has it at the manifest's size (its bytes are checked when read)."""
    manifest = Manifest.from_bytes(data, where=f"fast-tier manifest of {tag!r}")
    held = {
        name: tuple(i for i, held in enumerate(files) if held is not None and held.get(name) == size)
        for name, size in part_sizes(manifest).items()
    }
    held[MANIFEST_NAME] = tuple(holders)
    missing = tuple(sorted(n for n, where in held.items() if not where))
    return FastCandidate(tag, data, record_order(manifest), held, missing)


def part_sizes(manifest: Manifest) -> dict[str, int]:
    """A save's parts -- its data files, then the generation's metadata -- and their sizes."""
    return {f.name: f.size for f in manifest.files} | {manifest.metadata.name: manifest.metadata.size}


def newest_complete(
    ctx: DistContext, local_path: str, views: Sequence[Mapping[str, LocalCopy]], tag: str | None = None
) -> FastCandidate | None:
    """(all ranks) The newest copy (of ``tag``, when given) the surviving fast tiers hold completely;
    newer incomplete ones are named in a warning (rank 0)."""
    for t, digest in committed_copies(views, tag):
        found = fast_candidate(ctx, local_path, views, t, digest)
        if found is not None and found.complete:
            return found
        if found is not None and ctx.is_coordinator:
            log.warning(
                "fast tier: checkpoint %r is committed but incomplete across the surviving nodes (missing %s); "
                "not used",
                t,
                ", ".join(found.missing[:5]),
            )
    return None


def durable_seq(root: str, storage_options: Any) -> int:
    """(rank 0) The highest save number committed under ``root`` (one scan per process)."""
    if root not in _DURABLE_SEQ:
        records = scan_root(root, storage_options=storage_options)
        _DURABLE_SEQ[root] = max((seq_of(r.manifest) for r in records if r.committed), default=0)
    return _DURABLE_SEQ[root]


def note_durable_seq(root: str, seq: int) -> None:
    """A drain committed save number ``seq`` under ``root``."""
    _DURABLE_SEQ[root] = max(_DURABLE_SEQ.get(root, 0), seq)


def tier_seq(views: Sequence[Mapping[str, LocalCopy]]) -> int:
    """The highest save number any node's committed copy carries."""
    return max((c.seq for view in views for c in view.values() if c.digest is not None), default=0)


def retain_local(local_path: str, view: Mapping[str, LocalCopy], keep: int | None, protected: set[str]) -> list[str]:
    """(one rank per node) Keep the ``keep`` newest committed copies of this node (and ``protected``);
    remove older committed ones and uncommitted folders older than the newest commit. The removed tags."""
    committed = sorted(((c.order, tag) for tag, c in view.items() if c.digest is not None), reverse=True)
    if keep is None or not committed:
        return []
    kept = {tag for _, tag in committed[:keep]} | protected
    newest_mtime = os.stat(os.path.join(local_path, partial_dirname(committed[0][1]), MANIFEST_NAME)).st_mtime
    removed = []
    fs, root = open_root(local_path)
    for tag, copy in view.items():
        folder = os.path.join(local_path, partial_dirname(tag))
        if tag in kept:
            continue
        if copy.digest is None and os.stat(folder).st_mtime >= newest_mtime:
            continue  # possibly a save of another process still writing: only older debris goes
        # the protocol's removal: marked, manifest first (a kill half-way leaves no committed copy missing
        # parts), never through a link; an uncommitted folder only while it stays uncommitted
        path = join(root, partial_dirname(tag))
        failed = remove_folder(fs, path, path, uncommitted_only=copy.digest is None)
        if failed:
            log.warning("fast tier %s: could not remove %d file(s) of %r", local_path, len(failed), tag)
        else:
            removed.append(tag)
    return removed
