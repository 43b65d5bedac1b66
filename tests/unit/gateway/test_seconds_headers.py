"""X-TTFT-Target, X-TPOT-Target and X-Request-Timeout take a plain decimal number of seconds: the
forms Python's float() also reads (``1_0``, ``inf``, ``nan``, surrounding text) are refused with a
400 naming the header, not read as something the client did not write."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.gateway.body import seconds_header as _seconds_header


def _req(value: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": [(b"x-ttft-target", value.encode())]})


@pytest.mark.parametrize("value,seconds", [("2", 2.0), ("0.5", 0.5), (".25", 0.25), ("3.", 3.0), ("1e-3", 0.001),
                                           (" 4 ", 4.0), ("+1.5", 1.5)])
def test_plain_decimal_seconds_are_read(value: str, seconds: float) -> None:
    assert _seconds_header(_req(value), "x-ttft-target") == seconds


@pytest.mark.parametrize("value", ["1_0", "inf", "nan", "Infinity", "0x10", "1e", "", "2s", "1e999", "0", "-1"])
def test_other_forms_are_refused_naming_the_header(value: str) -> None:
    with pytest.raises(InvalidRequest) as got:
        _seconds_header(_req(value), "x-ttft-target")
    assert got.value.param == "x-ttft-target"
