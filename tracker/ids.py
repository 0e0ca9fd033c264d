"""Message identity: where a record sits in Kafka.

A message is identified by ``(topic, partition, offset)``. A redelivered copy is a new record
with its own position; it carries the *origin* id (the first delivery's position) in headers so
that one logical message can be followed through all of its copies.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from tracker.errors import InvalidHeader

#: Kafka's own rule for topic names (``org.apache.kafka.common.internals.Topic``).
TOPIC_NAME_RE = re.compile(r"[a-zA-Z0-9._-]{1,249}")
MAX_TOPIC_LENGTH = 249


def is_valid_topic(name: str) -> bool:
    """Whether ``name`` is a legal Kafka topic name (and not ``.`` or ``..``)."""
    return TOPIC_NAME_RE.fullmatch(name) is not None and name not in {".", ".."}


class MessageId(NamedTuple):
    """The position of one Kafka record: ``topic/partition/offset``."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    @classmethod
    def parse(cls, text: str) -> MessageId:
        """Parse the ``topic/partition/offset`` form used in headers, logs and the API.

        Topic names cannot contain ``/``, so the form is unambiguous.
        """
        parts = text.split("/")
        if len(parts) != 3:
            raise InvalidHeader(f"message id {text!r} is not of the form topic/partition/offset")
        topic, partition, offset = parts
        if not is_valid_topic(topic):
            raise InvalidHeader(f"message id {text!r} has an invalid topic name")
        if not (partition.isascii() and partition.isdigit()) or not (
            offset.isascii() and offset.isdigit()
        ):
            raise InvalidHeader(f"message id {text!r} has a non-numeric partition or offset")
        p, o = int(partition), int(offset)
        if p > 2**31 - 1 or o > 2**63 - 1:
            raise InvalidHeader(f"message id {text!r} is out of range")
        return cls(topic, p, o)
