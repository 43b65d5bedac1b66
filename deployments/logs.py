"""Narwhal's own log lines in a Serve replica's log, at their level."""

from __future__ import annotations

import logging
import logging.handlers


def to_serve_log() -> None:
    """Loggers under ``narwhal`` write through the handlers Serve gave this replica's logger, so a
    warning or an error reaches the replica's log as one (with the replica's name and the request's
    id). Without this they fall to Python's last-resort handler on standard error, which Serve
    re-logs as INFO lines (found by a hostile probe: a tokenization disagreement, logged as an
    error, read INFO). Warnings and above, as before; the request log (``narwhal.requests``) keeps
    its own handler, standard output.  In throughput mode Serve's handler is a buffer of 1,000
    records written when full or at an ERROR, and never at a replica's stop: a quiet replica's
    warnings (an engine process that died, a failed report) would wait there and die with it, so
    Narwhal's lines go to the handler behind that buffer, at once."""
    ours = logging.getLogger("narwhal")
    if ours.handlers:
        return
    for handler in logging.getLogger("ray.serve").handlers:
        target = handler.target if isinstance(handler, logging.handlers.MemoryHandler) else None
        ours.addHandler(target or handler)
    if ours.handlers:
        ours.propagate = False
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.WARNING)
