"""The store and Kafka clients one tracker replica runs on.

The composition root (``tracker.runtime.engine_connections``) builds them from the settings
and hands them to the :class:`~tracker.engine.process.Tracker`, which from then on owns them:
it starts them in order, shares them among its loops (and with the API it serves) and closes
them on the way out. Building them elsewhere than in the engine is what lets a test or an
embedding application give a replica clients of its own making.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tracker.kafka.originals import OriginalsReader
from tracker.kafka.scan import PartitionScanner
from tracker.settings import TrackerSettings
from tracker.store import Store

#: The markers consumer's fetch settings unless ``kafka_consumer_config`` says otherwise. The
#: tracker may only act on a deadline once it has read every marker written before it, and it
#: learns how far the log went from fetch responses: a broker that answers a long poll only
#: when ``fetch_max_wait_ms`` runs out (the test broker does, mid-wait data or not) would hold
#: that knowledge back by up to the wait, and on any broker an idle markers topic tells that
#: nothing new was written only when the wait runs out. 25 ms bounds it; an idle tracker
#: then sends 40 small fetch requests a second per broker, which no broker notices. With
#: 100 ms, the lateness bench's p99 after deadline + ``ack_grace`` was ~195 ms, with 25 ms
#: ~55 ms (docs/benchmarks.md, change 51). A START and its SETTLE then come in separate
#: responses, as they do on Kafka; the flush keeps them together (``flush_cut``).
MARKERS_FETCH: dict[str, Any] = {"fetch_max_wait_ms": 25}


def markers_fetch_options(
    settings: TrackerSettings, client_config: dict[str, Any]
) -> dict[str, Any]:
    """The markers consumer's options: :data:`MARKERS_FETCH`, the client's security options,
    then the operator's ``kafka_consumer_config`` over both."""
    return {**MARKERS_FETCH, **client_config, **settings.kafka_consumer_config}


def markers_poll_wait(fetch_options: dict[str, Any]) -> float:
    """How long one poll of the markers waits, for a consumer built with ``fetch_options``:
    no longer than its fetches do (the horizon moves with each answer; 500 ms is aiokafka's
    default ``fetch_max_wait_ms``)."""
    return max(0.01, int(fetch_options.get("fetch_max_wait_ms", 500)) / 1000)


@dataclass(frozen=True)
class EngineConnections:
    """What a replica talks to. Not started: the tracker starts and closes them."""

    store: Store
    #: reads the markers topic in the tracker group (assigned by Kafka across replicas)
    markers_consumer: AIOKafkaConsumer
    #: copies, dead letters, parked markers, redrives (``acks=all``)
    producer: AIOKafkaProducer
    #: reads original messages back by position
    originals: OriginalsReader
    #: cluster metadata and end offsets (output topics' partitions, redrive scans)
    scanner: PartitionScanner
    #: the security options every client of the replica was built with (the tracker's own
    #: admin clients take them too: topic catalog, topic creation)
    client_config: dict[str, Any]
    #: how long one poll of the markers waits: no longer than ``markers_consumer`` fetches
    #: wait (:func:`markers_poll_wait`)
    markers_poll_wait: float
