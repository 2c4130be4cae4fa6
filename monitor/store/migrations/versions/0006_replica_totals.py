"""Per-replica run totals: ``replica_totals`` holds, per (replica id, run), the merged
accumulator of every batch that replica stored new, so a replica restarted with the same
``--replica-id`` continues its counters instead of restarting them at 0.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_totals",
        sa.Column("replica_id", sa.String(128), primary_key=True),
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("state", sa.JSON, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("tap_dropped", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("replica_totals")
