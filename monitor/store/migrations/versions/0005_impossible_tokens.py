"""``impossible_tokens``: a ``steps`` column and series chunks for the steps before it.

Before this revision a batch with a log-prob of -inf was refused, so every stored step had no
impossible token: existing rows get 0 and existing chunks an all-zero int64 array.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_NAME = "impossible_tokens"
_STEPS = "@steps"  # the series chunks' reserved step-number metric (store.series.STEPS)


def upgrade() -> None:
    op.add_column("steps", sa.Column(_NAME, sa.BigInteger, nullable=True))
    conn = op.get_bind()
    steps = sa.table("steps", sa.column(_NAME))
    conn.execute(sa.update(steps).values({_NAME: 0}))
    chunks = sa.table("series_chunks", sa.column("run_id"), sa.column("metric"),
                      sa.column("chunk"), sa.column("data"))  # fmt: skip
    rows = conn.execute(
        sa.select(chunks.c.run_id, chunks.c.chunk, chunks.c.data).where(chunks.c.metric == _STEPS)
    ).all()
    batch = [
        {"run_id": run, "metric": _NAME, "chunk": chunk, "data": bytes(len(data))}
        for run, chunk, data in rows
    ]
    for i in range(0, len(batch), 5000):
        conn.execute(sa.insert(chunks), batch[i : i + 5000])


def downgrade() -> None:
    conn = op.get_bind()
    chunks = sa.table("series_chunks", sa.column("metric"))
    conn.execute(sa.delete(chunks).where(chunks.c.metric == _NAME))
    op.drop_column("steps", _NAME)
