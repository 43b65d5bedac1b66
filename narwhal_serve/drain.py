"""Draining a run on SIGTERM (``scripts/serve_run.py``; docs/operations.md, "Stopping"): every application of
the run's config is told ``POST /admin/drain``, then polled until it holds no request, or its grace
period and a short flush have passed.  Plain HTTP to the run's own router; no Ray.  The same reading
of the config gives the limits HAProxy enforces for the run (:func:`ingress_limits`)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from narwhal_serve.config import ServingConfig
from narwhal_serve.runenv import IngressLimits

DRAIN_POLL_S = 0.2
# an application counts as drained once it has held no request for this long: an ingress replica
# reports an admission it made just before the drain a few milliseconds later, a quiet one within
# its renewal period (gateway/reporter.py RENEW_S), so one empty /status alone may be early
DRAIN_QUIET_S = 1.0
DRAIN_FLUSH_S = 2.0  # after the grace: the ingress ends the streams still open and flushes their events


@dataclass
class DrainTarget:
    """One application of the run: where its admin routes are, its token, its ``serving`` section
    (its grace period, and the limits HAProxy enforces for it: :class:`IngressLimits`)."""

    base: str  # http://host:port/prefix
    token_env: str
    serving: ServingConfig

    @property
    def grace_s(self) -> float:
        return self.serving.drain_grace_s


def ingress_limits(targets: list[DrainTarget]) -> IngressLimits:
    """HAProxy's limits for the run's applications (the defaults' when the config named none)."""
    return IngressLimits.of([t.serving for t in targets] or [ServingConfig()])


def drain_targets(args: list[str], log: Callable[[str], None] = print) -> list[DrainTarget]:
    """The applications of the config ``serve run`` was given (the first argument that is a file)."""
    path = next((a for a in (args or ["serve_config.yaml"]) if not a.startswith("-") and os.path.isfile(a)), None)
    if path is None:
        return []
    try:
        import yaml  # type: ignore[import-untyped]

        cfg = yaml.safe_load(Path(path).read_text()) or {}
        http = cfg.get("http_options") or {}
        host = str(http.get("host") or "127.0.0.1")
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        port = int(http.get("port") or 8000)
        apps = list(cfg.get("applications") or [])
    except Exception as exc:  # a config serve run reads its own way (or will refuse): stop as before
        log(f"cannot read {path} ({type(exc).__name__}): SIGTERM stops without draining, HAProxy takes the "
            "default serving limits")
        return []
    out = []
    for app in apps:
        try:
            args_ = app.get("args") or {}
            prefix = str(app.get("route_prefix") or "/").rstrip("/")
            token_env = str((args_.get("admin") or {}).get("token_env") or "NARWHAL_ADMIN_TOKEN")
            serving = ServingConfig.model_validate(args_.get("serving") or {})
        except Exception as exc:  # this application only (it will refuse to start, or is not Narwhal's)
            log(f"{path}: application {app.get('name')!r} skipped for draining and HAProxy's limits "
                f"({type(exc).__name__})")
            continue
        out.append(DrainTarget(f"http://{host}:{port}{prefix}", token_env, serving))
    return out


def _call(url: str, token: str | None = None, body: dict[str, object] | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as r:  # noqa: S310 (the run's own router)
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


def drain(targets: list[DrainTarget], env: dict[str, str], stop: threading.Event,
          log: Callable[[str], None] = print) -> None:
    """Tell every application to drain (no new admissions, ``/ready`` 503), then wait until none
    has held a request for DRAIN_QUIET_S (or its grace period and the flush after it pass, or a
    second signal)."""
    started = time.monotonic()
    waiting = []
    for t in targets:
        code, _ = _call(t.base + "/admin/drain", env.get(t.token_env), {"grace_s": t.grace_s})
        if code == 200:
            waiting.append(t)
        else:
            log(f"drain of {t.base} failed (HTTP {code}); it stops without draining")
    if waiting:
        log(f"draining {', '.join(t.base for t in waiting)} (grace {max(t.grace_s for t in waiting):g} s)")
    empty_since: dict[str, float] = {}
    while waiting and not stop.is_set():
        left = []
        for t in waiting:
            code, snap = _call(t.base + "/status")
            gauges = snap.get("gauges", {}) if isinstance(snap, dict) else {}
            held = (gauges.get("retained", 0) or 0) + (gauges.get("queued", 0) or 0)
            now = time.monotonic()
            if code == 200 and held == 0:
                if now - empty_since.setdefault(t.base, now) >= DRAIN_QUIET_S:
                    continue
            else:
                empty_since.pop(t.base, None)
            if time.monotonic() - started > t.grace_s + DRAIN_FLUSH_S:
                log(f"{t.base}: {held} request(s) still held after the grace period")
                continue
            left.append(t)
        waiting = left
        stop.wait(DRAIN_POLL_S)
    log(f"drained in {time.monotonic() - started:.1f} s")
