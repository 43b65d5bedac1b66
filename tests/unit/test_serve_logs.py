"""Narwhal's warnings and errors reach a Serve replica's log at their level (deployments/logs.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from deployments.logs import to_serve_log


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def serve_handler() -> Iterator[Keep]:
    ours, serve = logging.getLogger("narwhal"), logging.getLogger("ray.serve")
    saved = (list(ours.handlers), ours.propagate, ours.level, list(serve.handlers))
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    keep = Keep()
    serve.handlers[:] = [keep]
    try:
        yield keep
    finally:
        ours.handlers[:] = saved[0]
        ours.propagate = saved[1]
        ours.setLevel(saved[2])
        serve.handlers[:] = saved[3]


def test_narwhal_errors_go_through_serves_handlers_at_their_level(serve_handler: Keep) -> None:
    to_serve_log()
    to_serve_log()  # once
    # (pytest's own capture handlers may sit beside it once Ray's loggers were set up in this process)
    assert logging.getLogger("narwhal").handlers == logging.getLogger("ray.serve").handlers
    assert serve_handler in logging.getLogger("narwhal").handlers
    logging.getLogger("narwhal.tokenization").error("engine e1 tokenized request r1 otherwise")
    logging.getLogger("narwhal.kvevents").warning("a gap")
    logging.getLogger("narwhal.kvevents").info("not shown, as before")
    assert [(r.levelname, r.name) for r in serve_handler.records] == [("ERROR", "narwhal.tokenization"),
                                                                       ("WARNING", "narwhal.kvevents")]
    assert not logging.getLogger("narwhal").propagate  # not twice through the root's handlers
