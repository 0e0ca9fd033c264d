"""Kafka security options (TLS, SASL PLAIN / SCRAM) built from the settings.

No SASL-capable broker is available to the test suite (the tansu test broker speaks plaintext
only), so SASL is tested up to the aiokafka client arguments. TLS is tested for real: a CA, a
server and a client certificate are made with ``openssl``, and the context the tracker builds
completes a handshake with a local TLS server (and refuses one it must not trust).
"""

# ruff: noqa: S105, S106 - test credentials
from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import ValidationError

from tracker.kafka.client_security import (
    KafkaSecurityError,
    describe,
    kafka_client_options,
)
from tracker.settings import TrackerSettings

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KMQ_"):
            monkeypatch.delenv(name)


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with KEY_PASSWORD


KEY_PASSWORD = "key-secret"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(cwd: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        cwd=cwd,
    )  # fmt: skip


def _signed(cwd: Path, name: str, san: str, *, key_password: str | None = None) -> None:
    key_args = ["-passout", f"pass:{key_password}"] if key_password else ["-nodes"]
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", *key_args,
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=cwd,
    )  # fmt: skip
    (cwd / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    cwd = tmp_path_factory.mktemp("pki")
    _ca(cwd, "ca")
    _ca(cwd, "other")
    _signed(cwd, "server", "DNS:localhost,IP:127.0.0.1")
    _signed(cwd, "client", "DNS:kmq-tracker", key_password=KEY_PASSWORD)
    return Pki(
        ca=cwd / "ca.crt",
        other_ca=cwd / "other.crt",
        server_cert=cwd / "server.crt",
        server_key=cwd / "server.key",
        client_cert=cwd / "client.crt",
        client_key=cwd / "client.key",
    )


def settings(**values: Any) -> TrackerSettings:
    return TrackerSettings(**values)


# -- options -------------------------------------------------------------------------------


def test_plaintext_by_default_and_client_config_is_merged() -> None:
    options = kafka_client_options(settings(kafka_client_config={"request_timeout_ms": 5000}))
    assert options == {"security_protocol": "PLAINTEXT", "request_timeout_ms": 5000}


def test_legacy_security_in_client_config_still_wins_with_the_default_protocol() -> None:
    legacy = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}
    assert kafka_client_options(settings(kafka_client_config=legacy)) == legacy


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_plaintext_options(mechanism: str) -> None:
    options = kafka_client_options(
        settings(
            kafka_security_protocol="SASL_PLAINTEXT",
            kafka_sasl_mechanism=mechanism,
            kafka_sasl_username="tracker",
            kafka_sasl_password="s3cret",
        )
    )
    assert options == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": mechanism,
        "sasl_plain_username": "tracker",
        "sasl_plain_password": "s3cret",
    }
    assert describe(options)["sasl_plain_password"] == "**********"


def test_sasl_ssl_with_a_private_ca(pki: Pki) -> None:
    options = kafka_client_options(
        settings(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="SCRAM-SHA-512",
            kafka_sasl_username="tracker",
            kafka_sasl_password="s3cret",
            kafka_ssl_cafile=str(pki.ca),
        )
    )
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "ca"),),)]
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert "SSLContext" in str(describe(options)["ssl_context"])


def test_system_cas_without_a_cafile() -> None:
    options = kafka_client_options(settings(kafka_security_protocol="SSL"))
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED


def test_hostname_check_can_be_turned_off(pki: Pki) -> None:
    options = kafka_client_options(
        settings(
            kafka_security_protocol="SSL",
            kafka_ssl_cafile=str(pki.ca),
            kafka_ssl_check_hostname=False,
        )
    )
    assert options["ssl_context"].check_hostname is False
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED


def test_unreadable_files_name_the_setting(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(KafkaSecurityError, match="kafka_ssl_cafile"):
        kafka_client_options(
            settings(kafka_security_protocol="SSL", kafka_ssl_cafile=str(tmp_path / "nope.pem"))
        )
    with pytest.raises(KafkaSecurityError, match="kafka_ssl_certfile"):
        kafka_client_options(
            settings(
                kafka_security_protocol="SSL",
                kafka_ssl_cafile=str(pki.ca),
                kafka_ssl_certfile=str(pki.client_cert),
                kafka_ssl_keyfile=str(pki.client_key),
                kafka_ssl_key_password="wrong",
            )
        )


def test_settings_come_from_the_environment_and_never_show_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KMQ_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KMQ_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("KMQ_KAFKA_SASL_USERNAME", "tracker")
    monkeypatch.setenv("KMQ_KAFKA_SASL_PASSWORD", "hunter2-from-secret")
    loaded = TrackerSettings()
    assert loaded.kafka_sasl_password is not None
    assert loaded.kafka_sasl_password.get_secret_value() == "hunter2-from-secret"
    assert "hunter2" not in repr(loaded)
    assert "hunter2" not in str(loaded.model_dump())
    assert kafka_client_options(loaded)["sasl_plain_password"] == "hunter2-from-secret"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs kafka_sasl_mechanism"),
        (
            {
                "kafka_security_protocol": "SASL_PLAINTEXT",
                "kafka_sasl_mechanism": "PLAIN",
                "kafka_sasl_username": "u",
            },
            "needs kafka_sasl_password",
        ),
        ({"kafka_sasl_username": "u", "kafka_sasl_password": "p"}, "use SASL_SSL"),
        ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "GSSAPI"}, "PLAIN"),
        ({"kafka_ssl_cafile": "/ca.pem"}, "use SSL or SASL_SSL"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_keyfile": "/k.pem"},
            "kafka_ssl_keyfile needs kafka_ssl_certfile",
        ),
        (
            {
                "kafka_security_protocol": "SSL",
                "kafka_ssl_certfile": "/c.pem",
                "kafka_ssl_key_password": "p",
            },
            "kafka_ssl_key_password needs kafka_ssl_keyfile",
        ),
        (
            {"kafka_security_protocol": "SSL", "kafka_client_config": {"ssl_context": None}},
            "kafka_client_config sets ssl_context",
        ),
        ({"kafka_security_protocol": "TLS"}, "PLAINTEXT"),
    ],
)
def test_inconsistent_security_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrackerSettings(**values)


async def test_every_client_kind_accepts_the_options(pki: Pki) -> None:
    """The argument names are aiokafka's: the consumer, producer and admin take them."""
    options = kafka_client_options(
        settings(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="SCRAM-SHA-256",
            kafka_sasl_username="tracker",
            kafka_sasl_password="s3cret",
            kafka_ssl_cafile=str(pki.ca),
            kafka_ssl_certfile=str(pki.client_cert),
            kafka_ssl_keyfile=str(pki.client_key),
            kafka_ssl_key_password=KEY_PASSWORD,
        )
    )
    consumer = AIOKafkaConsumer(bootstrap_servers="localhost:9093", **options)
    producer = AIOKafkaProducer(bootstrap_servers="localhost:9093", **options)
    admin = AIOKafkaAdminClient(bootstrap_servers="localhost:9093", **options)
    try:
        assert consumer._client._security_protocol == "SASL_SSL"
        assert producer.client._sasl_mechanism == "SCRAM-SHA-256"
        assert admin._client._ssl_context is options["ssl_context"]
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.close()


# -- a real TLS handshake --------------------------------------------------------------------


async def _handshake(pki: Pki, client_context: ssl.SSLContext, *, mutual: bool) -> str:
    """Serve TLS on loopback with the server certificate; return what the server saw."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(pki.server_cert, pki.server_key)
    if mutual:
        server_context.load_verify_locations(pki.ca)
        server_context.verify_mode = ssl.CERT_REQUIRED
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert")
        seen.append(dict(x[0] for x in peer["subject"])["commonName"] if peer else "anonymous")
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "localhost", port, ssl=client_context, server_hostname="localhost"
        )
        try:
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    return seen[0]


async def test_the_context_completes_a_mutual_tls_handshake(pki: Pki) -> None:
    options = kafka_client_options(
        settings(
            kafka_security_protocol="SSL",
            kafka_ssl_cafile=str(pki.ca),
            kafka_ssl_certfile=str(pki.client_cert),
            kafka_ssl_keyfile=str(pki.client_key),
            kafka_ssl_key_password=KEY_PASSWORD,
        )
    )
    assert await _handshake(pki, options["ssl_context"], mutual=True) == "client"


async def test_a_server_signed_by_another_ca_is_refused(pki: Pki) -> None:
    options = kafka_client_options(
        settings(kafka_security_protocol="SSL", kafka_ssl_cafile=str(pki.other_ca))
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(pki, options["ssl_context"], mutual=False)
