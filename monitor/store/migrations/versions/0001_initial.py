"""Initial schema: runs, steps, step_details, batches, events.

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copy of the metric columns at this revision (later revisions add columns explicitly).
_POLICIES = ("estr", "delta_abs", "icepop", "kpop", "tis", "seq_mis", "geo_rs", "k3_rs")
_SEQ_POLICIES = ("seq_mis", "geo_rs", "k3_rs")
_COUNTS = ("tokens", "sequences", "nonfinite_tokens")
_FLOATS = (
    "mismatch_kl",
    "kl_k1",
    "kl_k2",
    "log_ratio_mean",
    "log_ratio_abs_mean",
    "log_ratio_abs_max",
    "log_ratio_abs_p99",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
    "is_ratio_mean",
    "is_ratio_std",
    "is_ratio_min",
    "is_ratio_max",
    "is_ess",
    "chi2_token",
    "seq_log_ratio_abs_mean",
    "seq_log_ratio_abs_max",
    "seq_geo_ratio_mean",
    "chi2_seq",
    "entropy_mean",
    "noise_scale",
    "entropy_delta_corr",
    "version_lag_mean",
    "version_lag_max",
    "intra_switch_ratio",
    "token_id_mismatch_ratio",
    "discrepancy_kl",
    "staleness_kl",
    "teacher_soft_ratio",
    "teacher_hard_ratio",
    *(f"mask_ratio_{p}" for p in _POLICIES),
    *(f"seq_reject_ratio_{p}" for p in _SEQ_POLICIES),
)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("first_seen", sa.Double, nullable=False),
        sa.Column("last_seen", sa.Double, nullable=False),
        sa.Column("last_step", sa.BigInteger, nullable=True),
        sa.Column("tags", sa.JSON, nullable=False),
    )
    op.create_table(
        "steps",
        sa.Column(
            "run_id",
            sa.String(128),
            sa.ForeignKey("runs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("step", sa.BigInteger, primary_key=True),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("batches", sa.Integer, nullable=False),
        sa.Column("policy_version", sa.BigInteger, nullable=True),
        sa.Column("entropy_source", sa.String(16), nullable=True),
        *(sa.Column(name, sa.BigInteger, nullable=True) for name in _COUNTS),
        *(sa.Column(name, sa.Double, nullable=True) for name in _FLOATS),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "step_details",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("step", sa.BigInteger, primary_key=True),
        sa.Column("state", sa.JSON, nullable=False),
        sa.Column("row", sa.JSON, nullable=False),
        sa.Column("length_buckets", sa.JSON, nullable=True),
        sa.Column("lag_buckets", sa.JSON, nullable=True),
        sa.Column("heatmap", sa.JSON, nullable=True),
        sa.Column("worst_tokens", sa.JSON, nullable=True),
    )
    op.create_table(
        "batches",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("batch_id", sa.String(256), primary_key=True),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("received_at", sa.Double, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("response", sa.JSON, nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("ts", sa.Double, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=True),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=True),
    )
    op.create_index("ix_events_run_ts", "events", ["run_id", "ts"])


def downgrade() -> None:
    op.drop_index("ix_events_run_ts", table_name="events")
    for table in ("events", "batches", "step_details", "steps", "runs"):
        op.drop_table(table)
