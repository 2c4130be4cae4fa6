"""Batch identity and run lifecycle: ``batches.digest`` (the content digest a ``batch_id`` is
checked against) and ``runs.finished_at``. Both nullable: rows stored before this revision have
neither, and a NULL digest replays like before.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("digest", sa.String(32), nullable=True))
    op.add_column("runs", sa.Column("finished_at", sa.Double, nullable=True))


def downgrade() -> None:  # SQLite ≥ 3.35 drops columns in place
    op.drop_column("runs", "finished_at")
    op.drop_column("batches", "digest")
