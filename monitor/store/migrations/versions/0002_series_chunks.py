"""Columnar series chunks for fast history reads, backfilled from ``steps``.

Revision ID: 0002
Revises: 0001
Create Date: 2025-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Frozen copy of the metric columns at this revision (later revisions backfill what they add).
_POLICIES = ("estr", "delta_abs", "icepop", "kpop", "tis", "seq_mis", "geo_rs", "k3_rs")
_SEQ_POLICIES = ("seq_mis", "geo_rs", "k3_rs")
_INTS = ("tokens", "sequences", "nonfinite_tokens", "batches", "policy_version")
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
    from timwatch.monitor.store.series import backfill

    op.create_table(
        "series_chunks",
        sa.Column(
            "run_id",
            sa.String(128),
            sa.ForeignKey("runs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("metric", sa.String(64), primary_key=True),
        sa.Column("chunk", sa.BigInteger, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    backfill(op.get_bind(), (*_INTS, *_FLOATS), _INTS)


def downgrade() -> None:
    op.drop_table("series_chunks")
