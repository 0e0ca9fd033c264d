"""The consumer-side client: consume with per-message ack/retry/extend/reject, produce delayed."""

from .consumer import DEFAULT_MARKERS_TOPIC, KmqConsumer
from .handlers import Handler, HandlerReturnedAwaitable, RejectMessage, RetryMessage
from .marker_sink import KafkaMarkerSink, MarkerSink
from .message import KmqMessage
from .ordering import Ordering
from .pool_config import WorkerStats
from .producer import KmqProducer, resolve_deliver_at

__all__ = [
    "DEFAULT_MARKERS_TOPIC",
    "Handler",
    "HandlerReturnedAwaitable",
    "KafkaMarkerSink",
    "KmqConsumer",
    "KmqMessage",
    "KmqProducer",
    "MarkerSink",
    "Ordering",
    "RejectMessage",
    "RetryMessage",
    "WorkerStats",
    "resolve_deliver_at",
]
