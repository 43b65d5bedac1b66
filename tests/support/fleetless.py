"""The gateway app without a fleet, in-process: for the routes that never reach an engine (models,
tokenize, health, and requests refused before admission), called through httpx's ASGITransport."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.app import GatewayApp, build_api
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.tokenizer import build_tiny_tokenizer


class NoFleet:
    """Just what those routes touch.  ``watch`` parks as the scheduler's does: one that returns at
    once makes the reporter's watch loop spin without yielding, and a route that flushes the reporter
    (``/ready``, ``/status``, ``/metrics``) then hangs the event loop."""

    local_relay = None

    async def report(self, rep: Any) -> None:
        return None

    async def watch(self, lease_id: str) -> bool:
        await asyncio.sleep(3600)
        return False

    async def snapshot(self) -> dict[str, Any]:
        return {"ready": True, "state": "active"}

    async def metrics_text(self) -> str:
        return ""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face tokenizer directory (one per test module)."""
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def fleetless_app(tok_dir: Path, **cfg: Any) -> GatewayApp:
    """The app sizing prompts with ``tok_dir``'s tokenizer; ``cfg`` over a one-engine simulated config."""
    conf = NarwhalConfig.model_validate({"tokenizer": str(tok_dir), "sim": {"engines": [{"name": "u0"}]}, **cfg})
    return build_api(conf, NoFleet(), sizer=PromptSizer(HfTokenizer(tok_dir)))


class _AppClient(httpx.AsyncClient):
    """A client of the app in-process.  No lifespan runs here: leaving its ``async with`` stops the
    app's reporter, whose lease renewals went on in the session's event loop after the test."""

    def __init__(self, app: GatewayApp) -> None:
        super().__init__(transport=httpx.ASGITransport(app=app), base_url="http://t")
        self._app = app

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await super().__aexit__(*exc)
        finally:
            await self._app.state.reporter.stop()


def asgi_client(app: GatewayApp) -> httpx.AsyncClient:
    return _AppClient(app)
