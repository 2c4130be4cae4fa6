"""verl-parity metrics: new ``steps`` columns and null series chunks for the steps before them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import math
import struct

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Frozen copy of the columns this revision adds.
_VERL_SEQ = ("seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_max_k2", "seq_max_k3")
_NEW_POLICIES = ("token_k1", "token_k2", "token_k3", *_VERL_SEQ)
_FLOATS = (
    "is_ratio_fraction_low",
    "tis_weight_mean",
    "tis_weight_std",
    "tis_weight_ess",
    "prob_abs_diff_std",
    "prob_pearson_corr",
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "seq_is_weight_mean",
    "seq_is_weight_std",
    "seq_is_weight_max",
    "seq_is_weight_min",
    "seq_is_weight_max_deviation",
    "seq_is_ratio_fraction_high",
    "seq_is_ratio_fraction_low",
    *(f"mask_ratio_{p}" for p in _NEW_POLICIES),
    *(f"seq_reject_ratio_{p}" for p in _VERL_SEQ),
)
_STEPS = "@steps"  # the series chunks' reserved step-number metric (store.series.STEPS)
_NAN = struct.pack("<d", math.nan)


def upgrade() -> None:
    for name in _FLOATS:
        op.add_column("steps", sa.Column(name, sa.Double, nullable=True))
    # Steps stored before this revision have no values for the new metrics: give every
    # existing chunk a null (NaN) array of its length, so series reads stay whole.
    conn = op.get_bind()
    chunks = sa.table("series_chunks", sa.column("run_id"), sa.column("metric"),
                      sa.column("chunk"), sa.column("data"))  # fmt: skip
    rows = conn.execute(
        sa.select(chunks.c.run_id, chunks.c.chunk, chunks.c.data).where(chunks.c.metric == _STEPS)
    ).all()
    batch = [
        {"run_id": run, "metric": name, "chunk": chunk, "data": _NAN * (len(data) // 8)}
        for run, chunk, data in rows
        for name in _FLOATS
    ]
    for i in range(0, len(batch), 5000):
        conn.execute(sa.insert(chunks), batch[i : i + 5000])


def downgrade() -> None:
    conn = op.get_bind()
    chunks = sa.table("series_chunks", sa.column("metric"))
    conn.execute(sa.delete(chunks).where(chunks.c.metric.in_(_FLOATS)))
    for name in _FLOATS:  # SQLite ≥ 3.35 drops columns in place (keeps WITHOUT ROWID)
        op.drop_column("steps", name)
