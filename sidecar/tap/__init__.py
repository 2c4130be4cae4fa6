"""The trainer tap: a non-blocking, bounded queue that ships each step's packed μ, π and H to
`timwatch serve` from a daemon thread. Importing it loads numpy and safetensors, never
httpx, numba, FastAPI or torch (it posts over the standard library's ``http.client``)."""

from timwatch.sidecar.tap.shipper import Tap, TapStats

__all__ = ["Tap", "TapStats"]
