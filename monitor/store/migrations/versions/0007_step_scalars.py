"""Per-step scalars from the trainer's own logs: ``step_scalars`` (one row per run, step, kind
and name; `timwatch.monitor.core.scalars`).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "step_scalars",
        sa.Column(
            "run_id",
            sa.String(128),
            sa.ForeignKey("runs.id", ondelete="CASCADE"),
            primary_key=True,
        ),  # fmt: skip
        sa.Column("step", sa.BigInteger, primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("value", sa.Double, nullable=True),
        sa.Column("source", sa.String(32), nullable=True),
        sa.Column("origin", sa.String(128), nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("step_scalars")
