"""Checks of settings that only make sense together, kept apart from their declarations.

``TrackerSettings`` declares some 80 settings with their descriptions (the source of
docs/configuration.md); the rules that relate several of them are here, so that each reads as
one rule. They raise ``ValueError``, which pydantic reports as a validation error naming the
settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

#: aiokafka client arguments that the ``kafka_security_*`` / ``kafka_sasl_*`` / ``kafka_ssl_*``
#: settings produce; ``kafka_client_config`` may not set them as well.
KAFKA_SECURITY_CLIENT_KEYS = frozenset(
    {
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "ssl_context",
    }
)


class KafkaSecurityValues(Protocol):
    """The settings the Kafka security rules read (``TrackerSettings`` has them)."""

    @property
    def kafka_security_protocol(self) -> str: ...
    @property
    def kafka_ssl_keyfile(self) -> str | None: ...
    @property
    def kafka_ssl_certfile(self) -> str | None: ...
    @property
    def kafka_ssl_key_password(self) -> Any: ...
    @property
    def kafka_client_config(self) -> Mapping[str, Any]: ...


def check_kafka_security(settings: KafkaSecurityValues) -> None:
    """Kafka security settings that only make sense together (``tracker/kafka/client_security``):
    SASL settings with a SASL protocol and all three of them, TLS files with a TLS protocol, a
    key with its certificate, and no security arguments in ``kafka_client_config`` as well."""
    protocol = settings.kafka_security_protocol
    sasl = protocol.startswith("SASL_")
    tls = protocol.endswith("SSL")
    sasl_set = [
        name
        for name in ("kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password")
        if getattr(settings, name) is not None
    ]
    if sasl:
        missing = [
            name
            for name in ("kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password")
            if name not in sasl_set
        ]
        if missing:
            raise ValueError(f"kafka_security_protocol {protocol} needs {', '.join(missing)}")
    elif sasl_set:
        raise ValueError(
            f"{', '.join(sasl_set)} set but kafka_security_protocol is {protocol}: "
            "use SASL_SSL (or SASL_PLAINTEXT)"
        )
    tls_set = [
        name
        for name in (
            "kafka_ssl_cafile",
            "kafka_ssl_certfile",
            "kafka_ssl_keyfile",
            "kafka_ssl_key_password",
        )
        if getattr(settings, name) is not None
    ]
    if tls_set and not tls:
        raise ValueError(
            f"{', '.join(tls_set)} set but kafka_security_protocol is {protocol}: "
            "use SSL or SASL_SSL"
        )
    if settings.kafka_ssl_keyfile is not None and settings.kafka_ssl_certfile is None:
        raise ValueError("kafka_ssl_keyfile needs kafka_ssl_certfile")
    if settings.kafka_ssl_key_password is not None and settings.kafka_ssl_keyfile is None:
        raise ValueError("kafka_ssl_key_password needs kafka_ssl_keyfile")
    clashes = sorted(KAFKA_SECURITY_CLIENT_KEYS.intersection(settings.kafka_client_config))
    if clashes and (protocol != "PLAINTEXT" or sasl_set or tls_set):
        raise ValueError(
            f"kafka_client_config sets {', '.join(clashes)}: configure Kafka security "
            "with the kafka_security_protocol / kafka_sasl_* / kafka_ssl_* settings only"
        )
