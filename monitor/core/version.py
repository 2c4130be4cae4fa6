"""The version, read once from the installed distribution's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("timwatch")
except PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
