"""The folder put first on the ``PYTHONPATH`` of the vLLM servers the demo and the tests start:
its `sitecustomize` runs at the start of each of their Python processes (API server, engine
core, workers). Nothing here is imported by timwatch itself."""

from pathlib import Path

__all__ = ["FOLDER"]

FOLDER = Path(__file__).parent
