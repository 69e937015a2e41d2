"""The package version: one owner, ``pyproject.toml``, read from the installed distribution's metadata."""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["VERSION"]

try:
    VERSION: str = version("smpckpt")
except PackageNotFoundError:  # a source tree on sys.path without an install
    VERSION = "0+unknown"
