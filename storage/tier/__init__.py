"""The fast tier: a partial checkpoint in every node's own folder (node-local NVMe or ``/dev/shm``), each
rank's files also copied to other nodes over the process group, committed per node; read back with the
parts a node lacks fetched from peers. The API (``smpckpt.api``) drives it: ``save_checkpoint(...,
local_path=...)``."""

from smpckpt.storage.tier.reader import PeerFetchingReader
from smpckpt.storage.tier.stream import Replicator
from smpckpt.storage.tier.transfer import STREAMS, Transfer, fetch_transfers, run_transfers
from smpckpt.storage.tier.writer import FastTierWriter, PreparedCommit, commit_node_copy, parts_of

# writing and reading a fast-tier copy; moving its files between ranks
__all__ = ["FastTierWriter", "PreparedCommit", "commit_node_copy", "parts_of", "PeerFetchingReader"]
__all__ += ["STREAMS", "Transfer", "fetch_transfers", "run_transfers", "Replicator"]
