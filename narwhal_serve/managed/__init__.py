"""Ray-managed engines: an engine entry with a ``launch`` spec instead of a ``url``.

* :mod:`.spec` — the launch spec (pydantic; validated with the rest of the config).
* :mod:`.command` — pure builders: the engine's argv and environment, the Serve deployment options.
* :mod:`.process` — one engine process: start, wait for ``/health``, watch, stop (plain asyncio).
* :mod:`.slot` — what a replica reports and what the scheduler keeps per managed engine.

The Ray side is ``deployments/engine.py`` (one replica supervises one engine process); the
scheduler's bookkeeping is :mod:`narwhal_serve.scheduler.managed`.
"""
