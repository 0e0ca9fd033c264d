from __future__ import annotations

import pytest

from tracker.cli import main
from tracker.ids import MessageId
from tracker.protocol import Marker, encode_marker

pytestmark = pytest.mark.unit


def test_decode_marker_prints_fields(capsys: pytest.CaptureFixture[str]) -> None:
    value = encode_marker(Marker.reject("billing", MessageId("orders", 3, 42), reason="bad"))
    assert main(["decode-marker", value.hex()]) == 0
    out = capsys.readouterr().out
    assert "kind=REJECT" in out
    assert "topic=orders" in out
    assert "reason=bad" in out


def test_decode_marker_reports_bad_input_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode-marker", "09ff", "zz"]) == 1
    err = capsys.readouterr().err
    assert "invalid marker: unsupported marker version 9" in err
    assert "invalid hex" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert "kmq-tracker 0.1.0" in capsys.readouterr().out
