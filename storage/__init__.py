"""fsspec-backed DCP storage: local disk, shared filesystems, S3 and memory://."""

if __name__ != "smpckpt.storage":
    raise ImportError(
        f"this folder is the package 'smpckpt.storage'; import it by that name, not as {__name__!r} "
        "(install the project with `pip install -e .`)"
    )

__all__: list[str] = []
