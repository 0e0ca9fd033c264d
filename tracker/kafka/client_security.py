"""Kafka client security (TLS, SASL PLAIN / SCRAM) from the tracker's settings.

Every Kafka client the tracker creates (the markers consumer, the producer, the originals
reader, the admin clients) takes the same keyword arguments, built once here::

    options = kafka_client_options(settings)
    AIOKafkaConsumer(bootstrap_servers=..., **options)

The settings are checked together when they are loaded (``TrackerSettings``); this module
turns them into aiokafka arguments: ``security_protocol``, ``sasl_mechanism``,
``sasl_plain_username`` / ``sasl_plain_password`` (aiokafka uses these for SCRAM too) and an
``ssl_context`` made by :func:`aiokafka.helpers.create_ssl_context`. ``kafka_client_config``
(other aiokafka settings) is merged in; it may not set the security arguments itself once the
dedicated settings are used.
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context

from tracker.errors import KmqError
from tracker.settings import TrackerSettings


class KafkaSecurityError(KmqError):
    """The Kafka security settings cannot be used (e.g. a certificate file is unreadable)."""


def build_ssl_context(settings: TrackerSettings) -> ssl.SSLContext:
    """The TLS context for ``SSL`` / ``SASL_SSL``: CA, optional client certificate and key.

    Without ``kafka_ssl_cafile`` the system's trusted CAs are used. Raises
    :class:`KafkaSecurityError` naming the setting whose file cannot be loaded.
    """
    password = settings.kafka_ssl_key_password
    try:
        context: ssl.SSLContext = create_ssl_context(cafile=settings.kafka_ssl_cafile)
    except (OSError, ssl.SSLError) as exc:
        raise KafkaSecurityError(
            f"kafka_ssl_cafile {settings.kafka_ssl_cafile!r} cannot be loaded: {exc}"
        ) from exc
    if settings.kafka_ssl_certfile is not None:
        try:
            context.load_cert_chain(
                certfile=settings.kafka_ssl_certfile,
                keyfile=settings.kafka_ssl_keyfile,
                password=password.get_secret_value() if password is not None else None,
            )
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSecurityError(
                f"kafka_ssl_certfile {settings.kafka_ssl_certfile!r} / kafka_ssl_keyfile "
                f"{settings.kafka_ssl_keyfile!r} cannot be loaded: {exc}"
            ) from exc
    context.check_hostname = settings.kafka_ssl_check_hostname
    return context


def security_options(settings: TrackerSettings) -> dict[str, Any]:
    """Only the security arguments (no ``kafka_client_config``)."""
    protocol = settings.kafka_security_protocol
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = build_ssl_context(settings)
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        mechanism = settings.kafka_sasl_mechanism
        username = settings.kafka_sasl_username
        password = settings.kafka_sasl_password
        if mechanism is None or username is None or password is None:  # TrackerSettings checks
            raise KafkaSecurityError(
                f"{protocol} needs kafka_sasl_mechanism, kafka_sasl_username and "
                "kafka_sasl_password"
            )
        # aiokafka takes the SCRAM credentials in the sasl_plain_* arguments too.
        options["sasl_mechanism"] = mechanism
        options["sasl_plain_username"] = username
        options["sasl_plain_password"] = password.get_secret_value()
    return options


def kafka_client_options(settings: TrackerSettings) -> dict[str, Any]:
    """Keyword arguments for every aiokafka client: security + ``kafka_client_config``.

    With the default ``PLAINTEXT`` and nothing else set, ``kafka_client_config`` may still
    carry its own ``security_protocol`` (and the rest) as before; it then wins.
    """
    options = security_options(settings)
    options.update(settings.kafka_client_config)
    return options


def describe(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` safe to log: the SASL password masked, the TLS context summarised."""
    shown: dict[str, Any] = {}
    for key, value in options.items():
        if "password" in key and value is not None:
            shown[key] = "**********"
        elif isinstance(value, ssl.SSLContext):
            shown[key] = f"SSLContext(check_hostname={value.check_hostname})"
        else:
            shown[key] = value
    return shown
