"""The trainer tap: a non-blocking, bounded queue that ships each step's packed μ, π and H to
`timwatch serve` from a daemon thread. Importing it loads numpy, httpx and safetensors, never
numba, FastAPI or torch."""

from timwatch.sidecar.tap.shipper import Tap, TapStats

__all__ = ["Tap", "TapStats"]
