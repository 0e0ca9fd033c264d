"""The test vectors of docs/protocol.md (both versions), as the document gives them.

Each is a fenced block of hex bytes after a ``<!-- vector:NAME -->`` comment; the protocol
tests check them against the encoder and every decoder (Python, C, the pipeline's JVM one).
"""

from __future__ import annotations

import re
from pathlib import Path

from tracker.errors import MarkerError
from tracker.protocol import decode_marker, py_decode_any

PROTOCOL_DOC = Path(__file__).parents[2] / "docs" / "protocol.md"


def documented_vectors() -> dict[str, bytes]:
    """``{name: value}`` of every test vector in docs/protocol.md."""
    found = re.findall(
        r"<!-- vector:(\w+) -->\s*```\s*\n([0-9a-f ]+)\n```", PROTOCOL_DOC.read_text()
    )
    return {name: bytes.fromhex(hexes.replace(" ", "")) for name, hexes in found}


def with_nul_for_x(value: bytes) -> bytes:
    """``value`` (an encoded marker with exactly one ``X`` in one text field) with a NUL
    character where the ``X`` was: what both decoders must refuse alike."""
    assert value.count(b"X") == 1
    return value.replace(b"X", b"\x00")


def refusals(value: bytes) -> list[str]:
    """Why the decoder in use (C where built) and the Python reference refuse ``value``."""
    found = []
    for decode in (decode_marker, py_decode_any):
        try:
            decode(value)
        except MarkerError as refused:
            found.append(str(refused))
        else:
            found.append("accepted")
    return found
