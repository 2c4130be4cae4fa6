"""``python -m benchmarks.collapse_lab.report DIR [DIR…] [--md FILE] [--plots DIR]``: the lead-time
table (Markdown) and one plot per mismatch source from the runs under the DIRs.

Collapse is recomputed from each run's steps.jsonl with `configs.collapse_onset`; the alert
firings are those the replay stored. A page (or warning) on a run that did not collapse is a false
page (warning); lead = onset − first firing, in steps and in % of the run's steps.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.configs import collapse_onset


def _with_firsts(r: dict[str, Any]) -> dict[str, Any]:
    for sev in ("page", "warning"):
        hits = [f["step"] for f in r["firings"] if f["severity"] == sev]
        r[f"first_{sev}"] = min(hits) if hits else None
    return r


def load(dirs: list[Path]) -> list[dict[str, Any]]:
    """Runs from lab output folders (DIR/*/result.json) or from `--export` summary files."""
    runs = []
    for d in dirs:
        if d.is_file():  # a committed summary: one run per line, the log as per-step arrays
            for line in d.open():
                r = json.loads(line)
                cols = r.pop("log")
                rows = zip(*cols.values(), strict=True)
                r["log"] = [dict(zip(cols, vals, strict=True)) for vals in rows]
                r["series"], r["dir"] = [], None
                runs.append(_with_firsts(r))
            continue
        for res in sorted(d.glob("*/result.json")):
            r = json.loads(res.read_text())
            steps = [json.loads(line) for line in (res.parent / "steps.jsonl").open()]
            spath = res.parent / "series.jsonl"  # not committed: the plots need it, not the table
            series = [json.loads(line) for line in spath.open()] if spath.exists() else []
            r["collapse_step"] = collapse_onset(
                [s["reward"] for s in steps], [s["grad_norm"] for s in steps]
            )
            r["log"], r["series"], r["dir"] = steps, series, str(res.parent)
            grid = res.parent / "forecast.json"
            if grid.exists():
                r["grid"] = json.loads(grid.read_text())
            levels = res.parent / "levels.json"  # benchmarks/collapse_lab/levels.py
            if levels.exists():
                r["levels"] = json.loads(levels.read_text())
            runs.append(_with_firsts(r))
    return runs


def export(runs: list[dict[str, Any]], path: Path) -> None:
    """One line per run: what the tables need (the collapse step as computed from the full-
    precision log, firings, forecast-grid firings) and the per-step reward, gradient norm and
    enforced mask ratio at 4 significant digits (the plots need the run folders)."""
    keys = ("reward", "grad_norm", "mask_ratio")  # what the tables read
    with open(path, "w") as f:
        for r in sorted(runs, key=lambda r: (r["config"], r["seed"])):
            rec = {k: r[k] for k in ("config", "seed", "steps", "collapse_step", "firings")}
            rec["settings"], rec["grid"] = r["settings"], r.get("grid")
            rec["levels"] = r.get("levels")
            rec["log"] = {k: [float(f"{s[k]:.4g}") for s in r["log"]] for k in keys}
            f.write(json.dumps(rec) + "\n")


def outcomes(runs: list[dict[str, Any]]) -> str:
    """Final reward (mean of the last 20 steps), run-mean enforced mask ratio and largest
    gradient norm after the warm-up, per seed in seed order."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[r["config"]].append(r)
    rows = [
        "| configuration | final reward | enforced mask ratio, run mean | largest grad norm "
        "after step 20 |",
        "|---|---|---|---|",
    ]
    for cfg, rs in by.items():
        rs.sort(key=lambda r: r["seed"])
        final = [sum(s["reward"] for s in r["log"][-20:]) / 20 for r in rs]
        mask = [sum(s["mask_ratio"] for s in r["log"]) / len(r["log"]) for r in rs]
        grad = [max(s["grad_norm"] for s in r["log"][20:]) for r in rs]
        rows.append(
            f"| {cfg} | {', '.join(f'{v:.2f}' for v in final)} "
            f"| {', '.join(f'{v:.3f}' for v in mask)} | {', '.join(f'{v:.0f}' for v in grad)} |"
        )
    return "\n".join(rows) + "\n"


def rates(runs: list[dict[str, Any]]) -> str:
    """Per source (matched controls apart): how often the first page came before the onset on
    collapsed runs, against how often a page came at all on runs that did not collapse. Equal
    shares mean the page does not tell the two apart, whatever its lead."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        c = r["config"]
        by[c if c.startswith("control") else c.split("-")[0]].append(r)
    rows = [
        "| source | runs | collapsed | collapsed runs paged before onset | runs without a "
        "collapse paged | runs warned at step 16 |",
        "|---|---|---|---|---|---|",
    ]
    for src, rs in sorted(by.items()):
        col = [r for r in rs if r["collapse_step"] is not None]
        calm = [r for r in rs if r["collapse_step"] is None]
        hit = sum(
            r["first_page"] is not None and r["first_page"] <= r["collapse_step"] for r in col
        )
        paged = sum(r["first_page"] is not None for r in calm)
        early = sum(r["first_warning"] == 16 for r in rs)
        rows.append(
            f"| {src} | {len(rs)} | {len(col)} | {hit}/{len(col)} | {paged}/{len(calm)} "
            f"| {early}/{len(rs)} |"
        )
    return "\n".join(rows) + "\n"


def _cell(values: list[Any]) -> str:
    return ", ".join("–" if v is None else str(v) for v in values)


def _lead(r: dict[str, Any], sev: str) -> str:
    onset, first = r["collapse_step"], r[f"first_{sev}"]
    if onset is None:
        return "–"
    if first is None or first > onset:
        return "none" if first is None else f"late ({first - onset})"
    lead = onset - first
    return f"{lead} ({100 * lead / r['steps']:.0f} %)"


def table(runs: list[dict[str, Any]]) -> str:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[r["config"]].append(r)
    head = (
        "| configuration | seeds | collapsed | collapse step | first page | first warning "
        "| page lead, steps (% of run) | warning lead, steps (% of run) "
        "| false pages | false warnings |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for cfg, rs in by.items():
        rs.sort(key=lambda r: r["seed"])
        calm = [r for r in rs if r["collapse_step"] is None]
        rows.append(
            f"| {cfg} | {_cell([r['seed'] for r in rs])} "
            f"| {sum(r['collapse_step'] is not None for r in rs)}/{len(rs)} "
            f"| {_cell([r['collapse_step'] for r in rs])} "
            f"| {_cell([r['first_page'] for r in rs])} "
            f"| {_cell([r['first_warning'] for r in rs])} "
            f"| {'; '.join(_lead(r, 'page') for r in rs)} "
            f"| {'; '.join(_lead(r, 'warning') for r in rs)} "
            f"| {sum(r['first_page'] is not None for r in calm)}/{len(calm)} "
            f"| {sum(r['first_warning'] is not None for r in calm)}/{len(calm)} |"
        )
    return head + "\n".join(rows) + "\n"


def _shadow_mask(series: list[dict[str, float]], policy: str) -> list[float]:
    def total(snap: dict[str, float], name: str, pol: str | None) -> float:
        return sum(
            v for k, v in snap.items()
            if k.startswith(name + "{") and (pol is None or f'policy="{pol}"' in k)
        )  # fmt: skip

    out, prev_m, prev_t = [], 0.0, 0.0
    for snap in series:
        m = total(snap, "timwatch_masked_tokens_total", policy)
        t = total(snap, "timwatch_tokens_total", None)
        out.append((m - prev_m) / (t - prev_t) if t > prev_t else float("nan"))
        prev_m, prev_t = m, t
    return out


def finish_figure(
    fig: Any, axes: Any, ylabels: list[str], title: str, path: Path, dpi: int
) -> None:
    """The lab plots' common ending: one y label per panel, the step axis, the legend and
    ``title`` on the top panel, then the PNG at ``path``."""
    import matplotlib.pyplot as plt

    for ax, label in zip(axes, ylabels, strict=True):
        ax.set_ylabel(label)
    axes[-1].set_xlabel("RL step (= 1 min of Prometheus time)")
    axes[0].legend(fontsize=8, ncol=3)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot(runs: list[dict[str, Any]], source: str, path: Path, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in runs if r["seed"] == seed and r["config"].split("-")[0] in (source,)]
    # the matched control: an fp32 engine at the source's lag, learning rate and proximal policy
    key = ("lag", "lr", "proximal")
    ref = chosen[0]["settings"] if chosen else {}
    controls = [r for r in runs if r["seed"] == seed and r["config"].startswith("control")]
    matched = [r for r in controls if all(r["settings"][k] == ref.get(k) for k in key)]
    chosen += matched or [r for r in controls if r["config"] == "control"]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for i, r in enumerate(chosen):
        c = f"C{i}"
        x = [s["step"] for s in r["log"]]
        axes[0].plot(x, [s["reward"] for s in r["log"]], c, lw=0.8, label=r["config"])
        axes[1].semilogy(x, [max(s["grad_norm"], 1e-6) for s in r["log"]], c, lw=0.8)
        axes[2].semilogy(x, [max(s["mismatch_kl"], 1e-14) for s in r["log"]], c, lw=0.8)
        axes[3].plot(x, _shadow_mask(r["series"], "estr"), c, lw=0.8)
        if r["collapse_step"] is not None:
            for ax in axes:
                ax.axvline(r["collapse_step"], color=c, ls="-", lw=1.5, alpha=0.5)
        first: dict[str, dict[str, Any]] = {}
        for f in r["firings"]:  # sorted by step: the first firing of each alert, any label
            first.setdefault(f["alert"], f)
        for f in first.values():
            ls = "--" if f["severity"] == "page" else ":"
            for ax in axes:
                ax.axvline(f["step"], color=c, ls=ls, lw=0.9)
    finish_figure(
        fig, axes,
        ["reward", "grad norm", "mismatch k3 KL\n(π current vs μ)",
         "ESTR mask ratio\n(timwatch, shadow)"],
        f"collapse lab · source {source} · seed {seed} · solid: collapse onset · "
        "dashed: first page · dotted: first firing of each warning",
        path, 90,
    )  # fmt: skip


def main(
    dirs: Annotated[list[Path], typer.Argument(help="lab output folders or --export files")],
    md: Annotated[Path | None, typer.Option(help="write the tables here")] = None,
    plots: Annotated[Path | None, typer.Option(help="write one PNG per source here")] = None,
    export_to: Annotated[
        Path | None, typer.Option("--export", help="write a per-run summary (JSON lines)")
    ] = None,
) -> None:
    """Print the lead-time table of the runs under DIRS; optionally write it and the plots."""
    runs = load(dirs)
    text = table(runs) + "\n" + outcomes(runs) + "\n" + rates(runs)
    print(text)
    if md is not None:
        md.write_text(text)
    if export_to is not None:
        export(runs, export_to)
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        sources = sorted({r["config"].split("-")[0] for r in runs} - {"control", "mini"})
        for source in sources:
            plot(runs, source, plots / f"collapse-lab-{source}.png")


if __name__ == "__main__":
    typer.run(main)
