"""The test vectors of docs/protocol.md (both versions), as the document gives them.

Each is a fenced block of hex bytes after a ``<!-- vector:NAME -->`` comment; the protocol
tests check them against the encoder and every decoder (Python, C, the pipeline's JVM one).
"""

from __future__ import annotations

import re
from pathlib import Path

PROTOCOL_DOC = Path(__file__).parents[2] / "docs" / "protocol.md"


def documented_vectors() -> dict[str, bytes]:
    """``{name: value}`` of every test vector in docs/protocol.md."""
    found = re.findall(
        r"<!-- vector:(\w+) -->\s*```\s*\n([0-9a-f ]+)\n```", PROTOCOL_DOC.read_text()
    )
    return {name: bytes.fromhex(hexes.replace(" ", "")) for name, hexes in found}
