"""The incident report of a run: one self-contained HTML page (``timwatch report RUN --html``,
``GET /v1/runs/{run}/report.html``).

`build_report` gathers from the store (`data`), draws the figures (`plots`, matplotlib's Agg
canvas, no pyplot) and writes the page (`html`). matplotlib loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store import Store
    from .html import TokenText

__all__ = ["build_report"]


def build_report(
    store: Store,
    run: str,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    token_text: TokenText = None,
    against: str | None = None,
) -> str:
    """The report page of ``run`` over the inclusive step range; `LookupError` for an unknown
    run, `StoreUnavailable` when the store fails. With ``against`` (a run), the page opens with
    ``run`` compared against it (`timwatch.monitor.compare`; `LookupError` when unknown)."""
    from .data import gather
    from .html import render

    data = gather(store, run, from_step=from_step, to_step=to_step)
    comparison = None
    if against is not None:
        from ..compare import compare_series, comparison_markdown
        from ..diagnosis import load_series

        if not store.run_exists(against):
            raise LookupError(against)
        a = load_series(store, against, from_step, to_step)
        b = load_series(store, run, from_step, to_step)
        if len(a) and len(b):
            comparison = (against, comparison_markdown(compare_series(a, b)))
        else:
            comparison = (against, "_no steps to compare in the range asked_")
    return render(data, token_text=token_text, comparison=comparison)
