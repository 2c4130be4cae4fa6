"""The trainer tap: a non-blocking, bounded queue that ships each step's packed μ, π and H to
`timwatch serve` from a daemon thread. Importing it loads numpy, never safetensors, httpx,
numba, FastAPI or torch: it writes the safetensors body itself (`wire`) and posts over the
standard library's ``http.client``. Everything the shipper thread needs is imported up front:
an import from a daemon thread during interpreter shutdown fails."""

from ...monitor.core.errors import RunPaged
from ...monitor.core.page import Page
from .guard import MarkerFile
from .shipper import Tap
from .stats import TapStats

__all__ = ["MarkerFile", "Page", "RunPaged", "Tap", "TapStats"]
