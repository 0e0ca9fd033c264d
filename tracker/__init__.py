"""kmq-tracker: job-queue semantics for Kafka consumer groups, tracked by markers."""

from tracker.errors import (
    AlreadySettled,
    ClientClosed,
    InvalidDelay,
    InvalidHeader,
    KmqError,
    MarkerError,
    MarkerWriteFailed,
)
from tracker.ids import MessageId
from tracker.protocol import Marker, MarkerKind, decode_batch, decode_marker, encode_marker

__version__ = "0.1.0"

__all__ = [
    "AlreadySettled",
    "ClientClosed",
    "InvalidDelay",
    "InvalidHeader",
    "KmqError",
    "Marker",
    "MarkerError",
    "MarkerKind",
    "MarkerWriteFailed",
    "MessageId",
    "__version__",
    "decode_batch",
    "decode_marker",
    "encode_marker",
]
