"""SQLAlchemy 2 models of the history store.

One wide ``steps`` row per (run, step) with every scalar metric as its own column, so a
``metrics`` query reads only the columns asked for through the (run_id, step) primary key.
The bulky parts of a step (accumulator state, buckets, heatmap, worst tokens, full row) live in
``step_details`` so that scans of ``steps`` never touch them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "COUNT_COLUMNS",
    "FLOAT_COLUMNS",
    "MASK_POLICIES",
    "METRIC_COLUMNS",
    "SEQ_POLICIES",
    "VERL_COLUMNS",
    "Base",
    "BatchRecord",
    "Event",
    "ReplicaTotals",
    "Run",
    "StepScalar",
    "Step",
    "StepDetail",
    "series_table",
    "steps_table",
]

_VERL_SEQ = ("seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_max_k2", "seq_max_k3")
MASK_POLICIES = (
    "estr", "delta_abs", "icepop", "kpop", "tis", "seq_mis", "geo_rs", "k3_rs",
    "token_k1", "token_k2", "token_k3", *_VERL_SEQ,
)  # fmt: skip
SEQ_POLICIES = ("seq_mis", "geo_rs", "k3_rs", *_VERL_SEQ)
#: scalar metrics added by migration 0003 (verl parity)
VERL_COLUMNS = (
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
)

#: integer-valued metrics of a row
COUNT_COLUMNS = ("tokens", "sequences", "nonfinite_tokens", "impossible_tokens")
#: float-valued scalar metrics of a row (docs/reference/metrics.md), then the flattened per-policy
# ratios
FLOAT_COLUMNS = (
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
    *VERL_COLUMNS,
    *(f"mask_ratio_{p}" for p in MASK_POLICIES),
    *(f"seq_reject_ratio_{p}" for p in SEQ_POLICIES),
)
#: every column a ``metrics`` query may ask for
METRIC_COLUMNS = (*COUNT_COLUMNS, "batches", "policy_version", *FLOAT_COLUMNS)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, float: Double}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    first_seen: Mapped[float] = mapped_column(Double)
    last_seen: Mapped[float] = mapped_column(Double)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tags: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: Unix time of ``POST /v1/runs/{run}/finish``; cleared by the next batch (migration 0004)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)


steps_table = Table(
    "steps",
    Base.metadata,
    Column("run_id", String(128), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("updated_at", Double, nullable=False),
    Column("batches", Integer, nullable=False),
    Column("policy_version", BigInteger, nullable=True),
    Column("entropy_source", String(16), nullable=True),
    *(Column(name, BigInteger, nullable=True) for name in COUNT_COLUMNS),
    *(Column(name, Double, nullable=True) for name in FLOAT_COLUMNS),
    # SQLite: cluster rows by (run_id, step) so a series query is one ordered B-tree scan
    sqlite_with_rowid=False,
)


#: packed per-metric arrays of the step series (``store.series`` reads and writes them)
series_table = Table(
    "series_chunks",
    Base.metadata,
    Column("run_id", String(128), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("metric", String(64), primary_key=True),
    Column("chunk", BigInteger, primary_key=True),
    Column("data", LargeBinary, nullable=False),
)


class Step(Base):
    """One row per (run, step); metric columns come from ``COUNT_COLUMNS``/``FLOAT_COLUMNS``."""

    __table__ = steps_table


class StepDetail(Base):
    __tablename__ = "step_details"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    row: Mapped[dict[str, Any]] = mapped_column(JSON)
    length_buckets: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    lag_buckets: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    heatmap: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    worst_tokens: Mapped[Any] = mapped_column(JSON, nullable=True)


class BatchRecord(Base):
    __tablename__ = "batches"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Double)
    tokens: Mapped[int] = mapped_column(BigInteger)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: `timwatch.monitor.core.digest.batch_digest` of the content; NULL on rows stored before
    #: migration 0004 (such a batch_id replays whatever is posted under it)
    digest: Mapped[str | None] = mapped_column(String(32), nullable=True)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_ts", "run_id", "ts"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(128))
    ts: Mapped[float] = mapped_column(Double)
    kind: Mapped[str] = mapped_column(String(32))
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ReplicaTotals(Base):
    """What one replica (``timwatch serve --replica-id``) has counted for one run since the id
    was first used: the merge of every batch it stored new, written in that batch's own
    transaction, so a batch is acknowledged exactly when it is counted here. A restarted
    replica seeds its exported counters from its rows."""

    __tablename__ = "replica_totals"

    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)  # `Accumulator.to_state`
    step: Mapped[int] = mapped_column(BigInteger)  # the highest step it stored a batch of
    tap_dropped: Mapped[int] = mapped_column(BigInteger)  # drops reported with those batches
    updated_at: Mapped[float] = mapped_column(Double)  # wall time of its last batch


class StepScalar(Base):
    """One scalar a trainer logged for one step (``POST /v1/runs/{run}/scalars``, migration
    0007): ``kind`` is the canonical kind (`timwatch.monitor.core.scalars.KINDS`) or
    ``unmapped`` (then ``name`` is the trainer's own name); ``value`` NULL means the trainer
    logged a non-finite number. A step sent again overwrites its values: never counted twice."""

    __tablename__ = "step_scalars"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[float | None] = mapped_column(Double, nullable=True)
    source: Mapped[str | None] = mapped_column(String(32), nullable=True)
    origin: Mapped[str] = mapped_column(String(128))  # the name the trainer logged
    updated_at: Mapped[float] = mapped_column(Double)
