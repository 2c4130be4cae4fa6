"""``timwatch analyze FILE``: every metric and every policy's mask ratio of one batch file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["analyze"]


def analyze(
    file: Annotated[Path, typer.Argument(help="a batch as .json or .safetensors")],
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    tau: Annotated[float, typer.Option(help="ESTR τ (1.6 math, 0.7 agentic)")] = 1.6,
    eps: Annotated[float, typer.Option(help="ESTR ε")] = 0.01,
    delta_abs_c: Annotated[float, typer.Option(help="delta_abs C: c = √(τC)")] = 1.0,
    icepop_low: Annotated[float, typer.Option(help="IcePop α")] = 0.5,
    icepop_high: Annotated[float, typer.Option(help="IcePop β")] = 5.0,
    kpop_phi: Annotated[float, typer.Option(help="KPop φ")] = 0.1,
    tis_c: Annotated[float, typer.Option(help="TIS truncation C")] = 2.0,
    seq_mis_low: Annotated[float, typer.Option(help="sequence MIS lower bound")] = 0.5,
    seq_mis_high: Annotated[float, typer.Option(help="sequence MIS upper bound")] = 2.0,
    geo_rs_low: Annotated[float, typer.Option(help="Geo-RS lower bound")] = 0.999,
    geo_rs_high: Annotated[float, typer.Option(help="Geo-RS upper bound")] = 1.001,
    k3_rs_kappa: Annotated[float, typer.Option(help="K3-RS κ")] = 0.01,
    nonfinite: Annotated[str, typer.Option(help="refuse | drop non-finite tokens")] = "refuse",
) -> None:
    """Compute every metric and every policy's mask ratio for one batch file."""
    from timwatch.monitor.core.batch import Batch, BatchError
    from timwatch.monitor.core.engine import analyze as analyze_batch
    from timwatch.monitor.core.jsoncodec import dumps, loads
    from timwatch.monitor.core.masks import PolicyParams

    try:
        params = PolicyParams(
            tau=tau, eps=eps, delta_abs_c=delta_abs_c, icepop_low=icepop_low,
            icepop_high=icepop_high, kpop_phi=kpop_phi, tis_c=tis_c, seq_mis_low=seq_mis_low,
            seq_mis_high=seq_mis_high, geo_rs_low=geo_rs_low, geo_rs_high=geo_rs_high,
            k3_rs_kappa=k3_rs_kappa,
        )  # fmt: skip
        if nonfinite not in ("refuse", "drop"):
            raise ValueError("--nonfinite must be 'refuse' or 'drop'")
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            batch = Batch.from_safetensors(data, nonfinite=nonfinite)  # type: ignore[arg-type]
        else:
            try:
                obj = loads(data)
            except ValueError as exc:
                raise BatchError("body", f"{file} is not valid JSON: {exc}") from None
            batch = Batch.from_json(obj, nonfinite=nonfinite)  # type: ignore[arg-type]
    except (BatchError, ValueError, OSError) as exc:
        print(f"timwatch analyze: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    row = analyze_batch(batch, params).to_dict()
    if json_out:
        sys.stdout.write(dumps(row).decode() + "\n")
        return
    from timwatch.monitor.cli.render import render_row

    render_row(row, title=str(file))
