"""``timwatch analyze FILE``: every metric and every policy's mask ratio of one batch file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..core.errors import ConfigError
from ..core.masks import PolicyParams
from .params import check_nonfinite, with_policy_options

if TYPE_CHECKING:
    from ..core.batch import Batch

__all__ = ["analyze", "read_batch"]


def read_batch(file: Path, nonfinite: str = "refuse") -> Batch:
    """The batch in ``file`` (.safetensors by suffix, JSON otherwise). A missing or unreadable
    file raises `ConfigError`; a malformed batch `BatchError` naming the field and index."""
    from ..core.batch import Batch, BatchError

    mode = check_nonfinite(nonfinite)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{file} is a directory, not a batch file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        if file.suffix == ".safetensors":
            return Batch.from_safetensors(data, nonfinite=mode)
        return Batch.from_json_bytes(data, nonfinite=mode)
    except BatchError as exc:
        raise BatchError(exc.field, f"{file}: {exc}", exc.index) from None


@with_policy_options
def analyze(
    file: Annotated[Path, typer.Argument(help="a batch as .json or .safetensors")],
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    nonfinite: Annotated[str, typer.Option(help="refuse | drop non-finite tokens")] = "refuse",
    *,
    params: PolicyParams,
) -> None:
    """Compute every metric and every policy's mask ratio for one batch file."""
    batch = read_batch(file, nonfinite)  # refused (if it is) before the kernels load
    from ..core.engine import analyze as analyze_batch
    from ..core.jsoncodec import dumps

    row = analyze_batch(batch, params).to_dict()
    if json_out:
        sys.stdout.write(dumps(row).decode() + "\n")
        return
    from .render import render_row

    render_row(row, title=str(file))
