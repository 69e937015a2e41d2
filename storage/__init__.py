"""fsspec-backed DCP storage: local disk, shared filesystems, S3 and memory://."""

if __name__ != "smpckpt.storage":
    raise ImportError(
        f"this folder is the package 'smpckpt.storage'; import it by that name, not as {__name__!r} "
        "(install the project with `pip install -e .`)"
    )

from smpckpt.storage.backends._folder import write_bytes_atomic  # noqa: E402
from smpckpt.storage.backends._fs import BinaryPrefixes, FlatLayout, HexPrefixes, PrefixStrategy, open_fs  # noqa: E402
from smpckpt.storage.format._reading import ReadStats  # noqa: E402
from smpckpt.storage.format.manifest import MANIFEST_NAME, RAW_DESCRIPTOR, FileRecord, Manifest  # noqa: E402
from smpckpt.storage.full.options import FullOptions  # noqa: E402
from smpckpt.storage.full.writer import FullArtifactWriter  # noqa: E402
from smpckpt.storage.read.reader import FsspecStorageReader, FullArtifactReader  # noqa: E402
from smpckpt.storage.tools import (  # noqa: E402
    VerifyReport,
    abort_stale_uploads,
    checkpoint_state,
    last_activity,
    probe_checkpoint,
    read_manifest,
    removal_marked,
    remove_checkpoint,
    verify_checkpoint,
)
from smpckpt.storage.write.writer import FsspecStorageWriter  # noqa: E402

__all__ = ["FsspecStorageWriter", "FullArtifactWriter", "FullOptions", "PrefixStrategy", "FlatLayout", "HexPrefixes"]
__all__ += ["BinaryPrefixes", "FsspecStorageReader", "FullArtifactReader", "ReadStats", "checkpoint_state"]
__all__ += ["probe_checkpoint", "read_manifest", "last_activity", "abort_stale_uploads", "removal_marked"]
__all__ += ["verify_checkpoint", "VerifyReport", "remove_checkpoint", "open_fs", "write_bytes_atomic", "Manifest"]
__all__ += ["FileRecord", "MANIFEST_NAME", "RAW_DESCRIPTOR"]
