"""Embedded vLLM-compatible engine simulator (like llm-d's inference-sim).

Public API: :class:`narwhal_serve.config.sim.SimEngineConfig`, :func:`narwhal_serve.sim.app.create_app`,
:func:`narwhal_serve.sim.server.start_server` / :class:`narwhal_serve.sim.server.SimServer`, and the
``narwhal-sim`` console script (:func:`narwhal_serve.sim.cli.main`).
"""
