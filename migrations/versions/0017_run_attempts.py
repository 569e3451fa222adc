"""Attempts kept: a resume no longer deletes the data it supersedes (issue 39).

run_attempts: one row per abandoned attempt of a rank (the data earlier processes had stored from the
resume's step on, and their late batches), with what it holds and whether a second writer was seen;
run_attempt_parts: its data as gzip-compressed batch documents of the ingest wire format.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("from_step", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("seq_floor", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("late_batches", sa.Integer(), nullable=False),
        sa.Column("first_late_at", sa.Float(), nullable=True),
        sa.Column("last_late_at", sa.Float(), nullable=True),
        sa.Column("second_writer_at", sa.Float(), nullable=True),
        sa.Column("restored_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_run_attempts_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_run_attempts"),
    )
    op.create_index("ix_run_attempts_run_id_rank_from_step", "run_attempts", ["run_id", "rank", "from_step"])
    op.create_table(
        "run_attempt_parts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["run_attempts.id"],
            name="fk_run_attempt_parts_attempt_id_run_attempts",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_run_attempt_parts"),
    )
    op.create_index("ix_run_attempt_parts_attempt_id", "run_attempt_parts", ["attempt_id"])


def downgrade() -> None:
    op.drop_index("ix_run_attempt_parts_attempt_id", table_name="run_attempt_parts")
    op.drop_table("run_attempt_parts")
    op.drop_index("ix_run_attempts_run_id_rank_from_step", table_name="run_attempts")
    op.drop_table("run_attempts")
