"""The life of a redrive job and of each dead letter it republishes.

A job is ``pending`` until a runner takes it, ``running`` while one holds its lease, then
``done``, ``cancelled`` or ``failed``. Each of its items (one dead letter) goes from
``pending`` through ``sending`` (reserved: it may be on its way) to ``done``, or is
``skipped`` (already redriven, or its record is gone) or ``cancelled``.
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


FINISHED_STATES = (JobState.DONE, JobState.CANCELLED, JobState.FAILED)


class ItemState(enum.StrEnum):
    PENDING = "pending"
    SENDING = "sending"
    DONE = "done"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
