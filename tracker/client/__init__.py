"""The consumer-side client: consume with per-message ack/retry/extend/reject, produce delayed."""

from .consumer import DEFAULT_MARKERS_TOPIC, KmqConsumer
from .markers import KafkaMarkerSink, MarkerSink
from .message import KmqMessage
from .producer import KmqProducer, resolve_deliver_at

__all__ = [
    "DEFAULT_MARKERS_TOPIC",
    "KafkaMarkerSink",
    "KmqConsumer",
    "KmqMessage",
    "KmqProducer",
    "MarkerSink",
    "resolve_deliver_at",
]
