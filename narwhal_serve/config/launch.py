"""The launch spec of a managed engine (``engines[i].launch``, docs/operations.md, "Managed engines").

An engine entry carries either ``url`` (an engine you run) or ``launch`` (Narwhal starts it as a Ray
Serve deployment whose replicas each supervise one engine process).  Every rule here fails at
start-up with a message naming the key.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Kind = Literal["vllm", "sglang", "sim", "command"]
Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]
PLACEHOLDERS = ("host", "port", "model", "name", "python", "tp")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Resources(_Strict):
    """What one engine replica reserves from Ray (its replica actor holds it while the engine runs)."""

    num_cpus: float = Field(1.0, ge=0)
    # GPUs of the whole engine replica; with tensor_parallel_size > 1, split into one placement-group
    # bundle per tensor-parallel worker (num_gpus / tensor_parallel_size each)
    num_gpus: float = Field(0.0, ge=0)
    accelerator_type: str | None = None  # Ray's accelerator type, e.g. H100, A10G, L4
    custom: dict[str, float] = {}  # custom node resources, e.g. {zone_a: 1}

    @model_validator(mode="after")
    def _check(self) -> "Resources":
        bad = sorted(k for k, v in self.custom.items() if v < 0 or not k)
        if bad:
            raise ValueError(f"launch.resources.custom: amounts must be >= 0 with a name (bad: {bad})")
        return self


class LaunchSpec(_Strict):
    kind: Kind = "vllm"
    model: str | None = None  # vllm / sglang: model path or hub id (the served name is the config's `model`)
    # kind command: the argv, with {host} {port} {model} {name} {python} {tp} filled in
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] = ()  # extra command-line arguments, appended
    python: str | None = None  # the interpreter (default: the one running Narwhal)
    venv: str | None = None  # or a virtual environment: <venv>/bin/python, VIRTUAL_ENV and PATH set
    env: dict[str, str] = {}  # added to the engine's environment
    resources: Resources = Resources()
    tensor_parallel_size: int = Field(1, ge=1)
    placement_strategy: Strategy = "STRICT_PACK"  # of the bundles, with tensor_parallel_size > 1 and GPUs
    replicas: int = Field(1, ge=1)  # engine processes, one per Serve replica
    host: str | None = None  # bind address; None: the node's IP address (reachable from other nodes)
    ready_timeout_s: float = Field(600.0, gt=0)  # from spawn to /health answering 200
    # Serve asks the replica this often whether its engine runs; three failed answers in a row and
    # Serve replaces the replica (a new engine process)
    health_check_period_s: float = Field(2.0, gt=0)
    stop_grace_s: float = Field(10.0, ge=0)  # SIGTERM, then SIGKILL of the engine's process group
    log_dir: str | None = None  # engine logs (default: <tmp>/narwhal-engines)
    # vllm and sim engines publish their KV-cache events (vLLM: --kv-events-config, on two ports of
    # the node) and the scheduler follows them (docs/operations.md, "KV events")
    kv_events: bool = True

    @model_validator(mode="after")
    def _check(self) -> "LaunchSpec":
        if self.kind in ("vllm", "sglang") and not self.model:
            raise ValueError(f"launch.model is required with launch.kind: {self.kind} (a model path or hub id)")
        if self.kind == "sim" and self.model is not None:
            raise ValueError("launch.model is not used with launch.kind: sim (it serves the config's `model`)")
        if self.kind == "command":
            if not self.command:
                raise ValueError("launch.command is required with launch.kind: command "
                                 "(an argv list; {host} and {port} are filled in)")
        elif self.command is not None:
            raise ValueError(f"launch.command is only used with launch.kind: command (kind is {self.kind})")
        if self.python is not None and self.venv is not None:
            raise ValueError("launch.python and launch.venv: give at most one")
        for a in self.command or ():
            _check_placeholders(a)
        owned = owned_flags(self.kind, self.args)
        if owned:
            raise ValueError(f"launch.args: {', '.join(owned)} set by Narwhal itself for a {self.kind} engine "
                             "(the port, host and names it reaches and follows the engine by, its tensor "
                             "parallelism from launch.tensor_parallel_size, its KV events from launch.kv_events), "
                             "or not supported (data parallelism: one engine per replica; give replicas instead)")
        bad_env = sorted(k for k in self.env if not k or "=" in k)
        if bad_env:
            raise ValueError(f"launch.env: invalid variable names {bad_env}")
        tp, gpus = self.tensor_parallel_size, self.resources.num_gpus
        if tp > 1 and gpus > 0:
            if self.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
                raise ValueError(
                    f"launch.placement_strategy: {self.placement_strategy} would put tensor-parallel workers on "
                    "other nodes, where an engine process started by its replica cannot use their GPUs; "
                    "use STRICT_PACK (one node) or PACK")
            if gpus < tp or not float(gpus / tp).is_integer():
                raise ValueError(f"launch.resources.num_gpus ({gpus:g}) must be a multiple of "
                                 f"launch.tensor_parallel_size ({tp}): one whole-GPU bundle per "
                                 "tensor-parallel worker")
        return self

    @property
    def gpus_per_worker(self) -> float:
        return self.resources.num_gpus / self.tensor_parallel_size

    @property
    def uses_placement_group(self) -> bool:
        """One bundle per tensor-parallel worker (only GPU engines: a CPU engine needs no bundles)."""
        return self.tensor_parallel_size > 1 and self.resources.num_gpus > 0

    def interpreter(self, current: str) -> str:
        """The Python that runs the engine (``current``: the one running Narwhal)."""
        if self.venv is not None:
            return str(Path(self.venv) / "bin" / "python")
        return self.python or current

    def resolved(self, base: Path) -> "LaunchSpec":
        """Relative paths (venv, python, log_dir, a model that exists as a path) made absolute
        against ``base`` — the directory ``serve run`` started in; replicas may run elsewhere."""

        def absolute(p: str | None) -> str | None:
            if p is None or os.path.isabs(p):
                return p
            return str((base / p).resolve())

        update: dict[str, object] = {"venv": absolute(self.venv), "log_dir": absolute(self.log_dir)}
        if self.python is not None and os.sep in self.python:
            update["python"] = absolute(self.python)
        if self.model is not None and not os.path.isabs(self.model) and (base / self.model).exists():
            update["model"] = absolute(self.model)
        return self.model_copy(update=update)


# Flags of an engine's command line that Narwhal sets itself (the engine's parser takes the last
# one: a repeat in launch.args would win), or cannot follow (data parallelism: one KV-event socket
# and one port per engine), by kind; spelled as the engines' parsers take them (vLLM also reads
# --a_b as --a-b)
_OWNED_FLAGS = {
    "vllm": frozenset({"--host", "--port", "--model", "--served-model-name", "--kv-events-config",
                       "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--data-parallel-size-local",
                       "-dpl", "--pipeline-parallel-size", "-pp"}),
    "sglang": frozenset({"--host", "--port", "--model-path", "--model", "--served-model-name", "--tp-size",
                         "--tensor-parallel-size", "--tp", "--dp-size", "--data-parallel-size", "--dp",
                         "--pp-size", "--pipeline-parallel-size"}),
}


def flag_names(args: "tuple[str, ...] | list[str]", dashes: bool) -> list[str]:
    """The option names in ``args`` (``--a=b`` read as ``--a``, vLLM's ``--a.b c`` — one field of a
    JSON option — as ``--a``; with ``dashes``, ``--a_b`` as ``--a-b``)."""
    out = []
    for a in args:
        if not a.startswith("-") or a == "-" or (len(a) > 1 and (a[1].isdigit() or a[1] == ".")):
            continue  # a value (a negative number is one)
        name = a.split("=", 1)[0]
        if name.startswith("--"):
            name = name.split(".", 1)[0]
            if dashes:
                name = name.replace("_", "-")
        out.append(name)
    return out


def owned_flags(kind: str, args: "tuple[str, ...] | list[str]") -> list[str]:
    """The flags of ``args`` Narwhal sets itself for a ``kind`` engine, or cannot follow (an
    abbreviation of one too: the engines' parsers take a long option's unique prefix)."""
    owned = _OWNED_FLAGS.get(kind, frozenset())
    return sorted({f for f in flag_names(args, dashes=kind == "vllm")
                   if f in owned or (f.startswith("--") and len(f) > 3 and any(o.startswith(f) for o in owned))})


def _check_placeholders(arg: str) -> None:
    for _, field, _, _ in string.Formatter().parse(arg):
        if field is not None and field not in PLACEHOLDERS:
            raise ValueError(f"launch.command: unknown placeholder {{{field}}} in {arg!r} "
                             f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")


def slot_names(engine: str, replicas: int) -> list[str]:
    """The engines a managed entry puts in the fleet: its own name for one replica, else one per
    replica (``<name>-0`` …)."""
    return [engine] if replicas == 1 else [f"{engine}-{k}" for k in range(replicas)]
