"""The fast tier: a partial checkpoint in every node's own folder (node-local NVMe or ``/dev/shm``), each
rank's files also copied to other nodes over the process group, committed per node; read back with the
parts a node lacks fetched from peers. The API (``smpckpt.api``) drives it: ``save_checkpoint(...,
local_path=...)``."""

from smpckpt.storage.tier.reader import STREAMS, PeerFetchingReader, Transfer, fetch_transfers, run_transfers
from smpckpt.storage.tier.writer import FastTierWriter, PreparedCommit, Replicator, Workers, commit_node_copy, parts_of

# writing a fast-tier copy and its replicas (writer.py); reading one and moving its files between ranks (reader.py)
__all__ = ["FastTierWriter", "PreparedCommit", "commit_node_copy", "parts_of", "PeerFetchingReader"]
__all__ += ["STREAMS", "Transfer", "fetch_transfers", "run_transfers", "Replicator", "Workers"]
