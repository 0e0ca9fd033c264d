"""Request and response models of the admin API (the OpenAPI schema is generated from them),
one module per resource: ``message_models``, ``topic_models``, ``redrive_models`` (dead letters
and redrive jobs), ``marker_models`` (the sidecar), ``ops_models``; ``common`` holds the field
types, patterns and validators they share.

Times are ISO 8601 UTC datetimes on the wire (the store keeps milliseconds since the epoch);
a time given to the API must carry a timezone (``AwareDatetime``: a naive one is ambiguous, 422).
Every model carries an example, so ``/docs`` shows realistic payloads. Free-text inputs refuse
NUL characters and lone surrogates: neither can be stored (PostgreSQL text, UTF-8). Numbers and
flags of request bodies must be JSON numbers and booleans: ``"10"`` for a number is a client's
mistake, refused (422) rather than guessed.
"""

from tracker.domain.actions import ActionKind, ActionOutcome
from tracker.domain.jobs import ItemState, JobState

from .common import (
    EXAMPLE_TIME,
    MAX_OFFSET,
    MAX_PARTITION,
    TEXT_PATTERN,
    TOPIC_PATTERN,
    ErrorItem,
    ErrorResponse,
    GroupId,
    JsonBool,
    JsonFloat,
    JsonInt,
    Offset,
    Partition,
    Reason,
    TopicName,
    example_of,
    storable,
    text,
)
from .marker_models import (
    MarkerBatch,
    MarkerBody,
    MarkerIn,
    MarkerItem,
    MarkerKindName,
    MarkersAccepted,
    RangeKindName,
    RangeMarkerIn,
)
from .message_models import (
    ActionBody,
    ActionResponse,
    ActionView,
    BytesPreview,
    DeadLetterView,
    ExtendBody,
    HeaderPreview,
    MarkerEvent,
    MarkerHistory,
    MessageDetail,
    MessagePage,
    MessageState,
    MessageStatus,
    MessageSummary,
    PayloadPreview,
    Position,
)
from .ops_models import Check, Health, Readiness
from .redrive_models import (
    DeadLetterDetail,
    DeadLetterFilterBody,
    DeadLetterPage,
    RedriveCreate,
    RedriveItemPage,
    RedriveItemView,
    RedriveJobPage,
    RedriveJobView,
)
from .topic_models import BackoffView, GroupStats, PolicyView, TopicList, TopicStats

__all__ = [
    "EXAMPLE_TIME",
    "MAX_OFFSET",
    "MAX_PARTITION",
    "TEXT_PATTERN",
    "TOPIC_PATTERN",
    "ActionBody",
    "ActionKind",
    "ActionOutcome",
    "ActionResponse",
    "ActionView",
    "BackoffView",
    "BytesPreview",
    "Check",
    "DeadLetterDetail",
    "DeadLetterFilterBody",
    "DeadLetterPage",
    "DeadLetterView",
    "ErrorItem",
    "ErrorResponse",
    "ExtendBody",
    "GroupId",
    "GroupStats",
    "HeaderPreview",
    "Health",
    "ItemState",
    "JobState",
    "JsonBool",
    "JsonFloat",
    "JsonInt",
    "MarkerBatch",
    "MarkerBody",
    "MarkerEvent",
    "MarkerHistory",
    "MarkerIn",
    "MarkerItem",
    "MarkerKindName",
    "MarkersAccepted",
    "MessageDetail",
    "MessagePage",
    "MessageState",
    "MessageStatus",
    "MessageSummary",
    "Offset",
    "Partition",
    "PayloadPreview",
    "PolicyView",
    "Position",
    "RangeKindName",
    "RangeMarkerIn",
    "Readiness",
    "Reason",
    "RedriveCreate",
    "RedriveItemPage",
    "RedriveItemView",
    "RedriveJobPage",
    "RedriveJobView",
    "TopicList",
    "TopicName",
    "TopicStats",
    "example_of",
    "storable",
    "text",
]
