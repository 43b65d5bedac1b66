"""Ray-managed engines: an engine entry with a ``launch`` spec instead of a ``url``.

* :mod:`narwhal_serve.config.launch` — the launch spec (pydantic; a section of the config, and
  validated with it).
* :mod:`.command` — pure builders: the engine's argv and environment, the Serve deployment options.
* :mod:`.process` — one engine process: start, wait for ``/health``, watch, stop (plain asyncio).
* :mod:`.slot` — what a replica reports and what the scheduler keeps per managed engine.

The Ray side is ``deployments/engine.py`` (one replica supervises one engine process); the
scheduler's bookkeeping is :mod:`narwhal_serve.scheduler.managed`.
"""
