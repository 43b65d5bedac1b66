"""Typed application args (docs/configuration.md, "Configuration"). Unknown keys are rejected, naming the key.

Some sections live in their own modules: :mod:`.launch` (a managed engine's launch spec),
:mod:`.sim` (one simulated engine's timing and faults, also the simulator's own config),
:mod:`.tenants` (tenants and their budgets), :mod:`.health` (monitoring and the router lease) and
:mod:`.deployment` (Ray Serve sizing); field checks shared by the sections: :mod:`.checks`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from narwhal_serve.config.base import Strict as _Strict
from narwhal_serve.config.checks import engine_url, unique, zmq_endpoint
from narwhal_serve.config.deployment import DeploymentKnobs as DeploymentKnobs
from narwhal_serve.config.health import HAConfig as HAConfig
from narwhal_serve.config.health import LeaseConfig as LeaseConfig
from narwhal_serve.config.health import MonitoringConfig as MonitoringConfig
from narwhal_serve.config.launch import LaunchSpec as LaunchSpec
from narwhal_serve.config.launch import flag_names, slot_names
from narwhal_serve.config.sim import SimEngineConfig as SimEngineConfig
from narwhal_serve.config.tenants import TenantSpec as TenantSpec
from narwhal_serve.config.tenants import TenantsConfig as TenantsConfig
from narwhal_serve.exports import lazy_exports


class ServingConfig(_Strict):
    max_request_bytes: int = Field(1_048_576, gt=0)
    http_retention_limit: int = Field(4096, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, le=86400)  # (HAProxy's client timeout derives from it)
    api_keys: tuple[str, ...] = ()
    # SSE comment written while a stream is silent: behind Serve's HAProxy a client that left is
    # noticed only when a write to it fails (docs/operations.md, "Run modes")
    stream_keepalive_s: float = Field(5.0, gt=0)
    # an engine silent this long fails the attempt: another route before response headers, an
    # error event and [DONE] after
    engine_idle_timeout_s: float = Field(60.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0, le=86400)  # the whole request body must arrive within this → 408
    # Before response headers, an attempt with no first token this long moves to the next
    # candidate route (when there is one) and counts against the engine it waited on.
    # None: max(2 s, 3 × the larger of the request's TTFT target and its predicted TTFT).
    first_token_timeout_s: float | None = Field(None, gt=0)
    # Slow readers (direct-ingress mode): a stream whose unsent data at the ingress passes
    # stream_buffer_bytes, or one write that blocks longer than slow_reader_timeout_s, is cut
    # (engine request aborted, outcome failed/slow_reader) instead of being buffered.
    stream_buffer_bytes: int = Field(1_048_576, gt=0)
    slow_reader_timeout_s: float = Field(30.0, gt=0, le=86400)
    # the engines' --max-logprobs (vLLM's default 20): top_logprobs / logprobs above it are refused
    # by the router with a clear 400 (the engine's own answer is a validation dump)
    max_logprobs: int = Field(20, ge=0)
    # draining (POST /admin/drain, SIGTERM to the run command): how long requests in flight may
    # take to finish before the streams still open are ended with an error event
    drain_grace_s: float = Field(30.0, ge=0)
    # an answer cut after its first token continues on another engine where that can be exact
    # (docs/contract.md, "Engine failures"): at most this many times per request (0: never), each
    # continuation's first token within resume_first_token_s
    max_resumes: int = Field(1, ge=0)
    resume_first_token_s: float = Field(10.0, gt=0)
    # The prompt goes to vLLM engines as the router's own token IDs instead of its text, once an
    # engine's answers showed the same IDs (tokenization/forward.py): `completions` (any vLLM),
    # `all` (chat too: vLLM >= 0.32), `off`
    forward_prompt_ids: Literal["off", "completions", "all"] = "completions"

    @field_validator("forward_prompt_ids", mode="before")
    @classmethod
    def _bare_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not k.strip() for k in v):  # (a client's key is read stripped: a blank one is no key)
            raise ValueError("a key must not be empty or blank")
        return v

    def first_token_limit(self, ttft_budget_s: float) -> float:
        if self.first_token_timeout_s is not None:
            return self.first_token_timeout_s
        return max(2.0, 3.0 * ttft_budget_s)


class PriorityClass(_Strict):
    """A priority class (``X-Priority``), highest first in ``admission.classes``."""

    name: str = Field(pattern=r"^[a-z0-9_-]{1,32}$")
    # A request of this class is admitted only while its projected TTFT stays within this share of
    # the top class's TTFT target (admission.ttft_budget_s): the rest is headroom for the classes above
    ttft_share: float = Field(1.0, gt=0, le=1)


DEFAULT_CLASSES = (PriorityClass(name="interactive"), PriorityClass(name="standard"),
                   PriorityClass(name="batch", ttft_share=0.5))


class PhaseConcurrency(_Strict):
    prefill: int = Field(64, gt=0)
    decode: int = Field(1024, gt=0)


class AdmissionConfig(_Strict):
    mode: Literal["predictive", "open"] = "predictive"
    queue_limit: int = Field(1024, ge=0)
    max_wait_s: float = Field(30.0, gt=0)
    ttft_budget_s: float = Field(2.0, gt=0)
    max_ttft_budget_s: float = Field(60.0, gt=0)
    # Time per output token a route may be projected to give a new stream (None: no TPOT judgement);
    # a request's X-TPOT-Target overrides it, capped at max_tpot_budget_s
    tpot_budget_s: float | None = Field(None, gt=0)
    max_tpot_budget_s: float = Field(10.0, gt=0)
    # A projection is judged with the margin of this quantile of the engine's recent relative
    # prediction errors added (admitted requests meet the budget with about this confidence)
    ttft_confidence: float = Field(0.98, ge=0.5, lt=1.0)
    phase_concurrency: PhaseConcurrency = PhaseConcurrency()
    # Each ingress replica admits under a lease of permits from the scheduler, with no scheduler
    # call per request; off: every request asks the scheduler (the pre-lease path, for comparison)
    ingress_leases: bool = True
    # How long an ingress's report gathers events before it goes (its answer renews the lease's
    # view). Longer: fewer reports and grants for the scheduler to handle, views older by as much
    # (docs/performance.md, "Scale: what one scheduler holds"). Releases go at once while requests
    # wait in the scheduler's queue.
    report_linger_s: float = Field(0.005, ge=0, le=0.25)
    # Each lease parks a call at the scheduler that is answered when another holder placed
    # requests its view lacks and it has been quiet 10 ms; its ingress then reports at once, and
    # the answer's view has those placements
    # (docs/architecture.md, "Admission leases"). Off: a quiet lease's view is up to 500 ms old.
    lease_watch: bool = True
    # Priority classes, highest first (docs/contract.md, "Priority classes"): queued requests leave in class
    # order, lower classes keep headroom for higher ones, and engines that schedule by priority get it
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = "standard"  # a request without X-Priority (a tenant may set its own)

    @model_validator(mode="after")
    def _classes(self) -> "AdmissionConfig":
        if self.tpot_budget_s is not None and self.tpot_budget_s > self.max_tpot_budget_s:
            raise ValueError("admission.tpot_budget_s must not exceed admission.max_tpot_budget_s")
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names):
            raise ValueError("admission.classes: at least one class, names unique")
        if self.default_class not in names:
            raise ValueError(f"admission.default_class {self.default_class!r} is not one of admission.classes {names}")
        return self

    def class_rank(self, name: str) -> int | None:
        """0 for the top class; None for a name that is not a class."""
        return next((i for i, c in enumerate(self.classes) if c.name == name), None)


class KVEventsEndpoint(_Strict):
    """Where an engine publishes its KV-cache events (vLLM ``--kv-events-config``: ``endpoint``,
    ``replay_endpoint``, ``topic``), as the router connects to them (``tcp://HOST:PORT``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    _endpoints = field_validator("endpoint", "replay_endpoint")(classmethod(lambda cls, v: zmq_endpoint(v)))


class EngineConfig(_Strict):
    name: str
    # an engine you run; or, instead, `launch`: Narwhal starts it (docs/operations.md, "Managed engines"), and the
    # scheduler fills in the URL its replica reports ("" until then)
    url: str = ""
    launch: LaunchSpec | None = None
    role: Literal["prefill", "decode", "unified"] = "unified"
    dialect: Literal["vllm", "sglang", "openai"] = "vllm"
    wave: str = "a"
    bootstrap_port: int | None = Field(None, ge=1, le=65535)  # SGLang P/D: the prefill engine's bootstrap port
    # The engine's concurrent-sequence limit (vLLM --max-num-seqs): lets predictive admission see
    # requests queueing for a slot. Unset: inferred from scraped metrics once the engine queues.
    max_num_seqs: int | None = Field(None, gt=0)
    # The TTFT model's prior for this engine, before any measurement (and fading as measurements
    # arrive): fixed cost and seconds per prompt token. Unset: the model measured on the engines of
    # its role and dialect (their measurements pooled), until it has measurements of its own;
    # with none measured yet, 0.02 s + 0.0002 s/token.
    ttft_prior_a_s: float | None = Field(None, ge=0)
    ttft_prior_b_s_per_token: float | None = Field(None, gt=0)
    # The engine's KV-cache events: the router's index of what it caches is then exact (docs/operations.md,
    # "KV events"), not learned from where requests went
    kv_events: KVEventsEndpoint | None = None
    # The engine schedules by request priority (vLLM --scheduling-policy priority, SGLang
    # --enable-priority-scheduling): each request's class rank is sent as its `priority` (0 first)
    priority_scheduling: bool = False

    @model_validator(mode="before")
    @classmethod
    def _dialect_of_kind(cls, data: Any) -> Any:
        """A managed SGLang engine speaks SGLang's dialect unless told otherwise (Narwhal starts it)."""
        if isinstance(data, dict) and "dialect" not in data:
            launch = data.get("launch")
            kind = launch.kind if isinstance(launch, LaunchSpec) else launch.get("kind") if isinstance(launch, dict) else None
            if kind == "sglang":
                data = {**data, "dialect": "sglang"}
        return data

    _url = field_validator("url")(classmethod(lambda cls, v: engine_url(v)))

    @model_validator(mode="after")
    def _url_or_launch(self) -> "EngineConfig":
        if self.dialect == "openai" and self.role != "unified":
            raise ValueError(f"engine {self.name!r}: a plain OpenAI-compatible server serves whole requests (role "
                             "unified): the router runs no P/D with the openai dialect")
        if bool(self.url) == (self.launch is not None):
            raise ValueError(f"engine {self.name!r}: give exactly one of `url` (an engine you run) or "
                             f"`launch` (Narwhal starts it as a Ray deployment), not "
                             f"{'both' if self.url else 'neither'}")
        kind = self.launch.kind if self.launch is not None else None
        if kind in ("vllm", "sglang") and self.dialect in ("vllm", "sglang") and self.dialect != kind:
            raise ValueError(f"engine {self.name!r}: launch.kind {kind} with dialect {self.dialect}: a managed "
                             f"{kind} engine speaks the {kind} dialect")
        if kind in ("vllm", "sglang") and self.role != "unified":
            need = "--kv-transfer-config" if kind == "vllm" else "--disaggregation-mode"
            assert self.launch is not None
            if need not in flag_names(self.launch.args, dashes=kind == "vllm"):  # (``--a.b`` read as ``--a``)
                raise ValueError(f"engine {self.name!r}: a managed {kind} {self.role} engine needs its P/D flags in "
                                 f"launch.args ({need} …, and the connector's ports per replica): started without "
                                 "them it computes every prompt itself")
        return self

    @property
    def base_url(self) -> str:
        if not self.url:  # a managed engine before its replica registered: not routable
            raise ValueError(f"engine {self.name!r} has no URL yet (a managed engine still starting)")
        return self.url.rstrip("/")

    def names(self) -> list[str]:
        """The names this entry puts in the fleet (several for a managed engine with replicas)."""
        return [self.name] if self.launch is None else slot_names(self.name, self.launch.replicas)


class PlacementConfig(_Strict):
    """How admitted requests are placed (docs/configuration.md)."""

    # Prefer the engine that holds a request's prompt prefix (its KV blocks), weighed against load
    # and projected TTFT; the TTFT projection credits the cached tokens
    prefix_aware: bool = True
    prefix_block_chars: int = Field(256, ge=8)  # text prompts: one index block per this many characters
    prefix_block_tokens: int = Field(64, ge=1)  # token-ID prompts: one block per this many tokens
    prefix_index_blocks: int = Field(4096, ge=0)  # per engine, least recently placed evicted first
    prefix_view_blocks: int = Field(1024, ge=0)  # of those, the most recent sent to ingress leases
    prefix_max_blocks: int = Field(128, ge=1)  # blocks hashed per request (its first ones)
    # engines' KV events applied by this many shard deployments, each following a slice of the
    # engines, instead of in the scheduler's process (0; docs/operations.md, "KV-event shards")
    kv_event_shards: int = Field(0, ge=0, le=64)
    # Drift: an engine measured slower than its own models (TTFT and TPOT; EWMA of the relative
    # error) scores worse past drift_penalty_at, and past drift_out_at leaves rotation until
    # profiling requests show it behaves again (within drift_back_at)
    drift_penalty_at: float = Field(0.25, gt=0)
    drift_out_at: float = Field(1.0, gt=0)
    drift_back_at: float = Field(0.3, gt=0)
    drift_probe_s: float = Field(1.0, gt=0)  # between profiling requests (out, or penalized and idle)
    drift_probes: int = Field(3, ge=1)  # good profiling requests in a row to come back
    # Relative errors are taken against at least these (timer noise on a fast engine is not drift)
    drift_min_ttft_s: float = Field(0.25, gt=0)
    drift_min_tpot_s: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _drift(self) -> "PlacementConfig":
        if self.drift_back_at >= self.drift_out_at:  # (back at once, its score reset, then out again)
            raise ValueError("placement.drift_back_at must be below placement.drift_out_at")
        return self


class AdminConfig(_Strict):
    token_env: str = "NARWHAL_ADMIN_TOKEN"


class ObservabilityConfig(_Strict):
    # One JSON line per finished request on the "narwhal.requests" logger (docs/operations.md, "Logs and traces").
    request_log: bool = True
    log_prompt_text: bool = False  # off: the line never carries prompt or output text
    # OpenTelemetry spans (optional dependency, `pip install narwhal-serve[tracing]`): a request
    # span at the ingress, admission and engine-leg spans, W3C traceparent sent to the engines.
    tracing: bool = False
    otlp_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_ENDPOINT, else an SDK already set up
    service_name: str = "narwhal"


class SimFleetConfig(_Strict):
    """The embedded simulated fleet used when ``engines`` is empty (docs/testing.md, "Simulator")."""

    host: str = "127.0.0.1"
    base_port: int = Field(8100, gt=0, lt=65536)
    engines: tuple[SimEngineConfig, ...] = (
        SimEngineConfig(name="sim-prefill-0", role="prefill"),
        SimEngineConfig(name="sim-decode-0", role="decode"),
        SimEngineConfig(name="sim-unified-0", role="unified"),
    )
    # Each simulated engine publishes its KV-cache events as vLLM does, on a Unix socket named after
    # its HTTP port (ipc:///tmp/narwhal-sim-kv-PORT, -replay), and the router follows them
    kv_events: bool = True

    @model_validator(mode="after")
    def _fleet(self) -> "SimFleetConfig":
        if dup := unique([e.name for e in self.engines]):
            raise ValueError(f"sim.engines: names must be unique; repeated: {dup}")
        if self.base_port + len(self.engines) - 1 > 65535:
            raise ValueError("sim.base_port: its engines' ports (one each, from it) must stay below 65536")
        return self


class NarwhalConfig(_Strict):
    model: str = "narwhal-sim"
    # The model's Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json): the router
    # sizes prompts with their exact token IDs (chat rendered as vLLM renders it) and serves /tokenize
    # and /detokenize; `narwhal-sim`: the simulator's; `estimate`: none (4 characters a token). Unset:
    # the simulator's for simulated engines (the embedded fleet), a managed vLLM/SGLang engine's local
    # model directory, else the estimate.
    tokenizer: str | None = None
    serving: ServingConfig = ServingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    engines: tuple[EngineConfig, ...] = ()
    monitoring: MonitoringConfig = MonitoringConfig()
    placement: PlacementConfig = PlacementConfig()
    ha: HAConfig = HAConfig()
    admin: AdminConfig = AdminConfig()
    sim: SimFleetConfig = SimFleetConfig()
    deployment: DeploymentKnobs = DeploymentKnobs()
    observability: ObservabilityConfig = ObservabilityConfig()
    tenants: TenantsConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "NarwhalConfig":
        if self.tenants is not None:
            names = [c.name for c in self.admission.classes]
            for t in self.tenants.list:
                for key in ("default_class", "max_class"):
                    if getattr(t, key) is not None and getattr(t, key) not in names:
                        raise ValueError(f"tenant {t.name!r}: {key} {getattr(t, key)!r} is not one of admission.classes {names}")
        if self.tenants is not None and self.serving.api_keys:
            raise ValueError("serving.api_keys and tenants are exclusive: give the keys to tenants "
                             "(tenants.list[].key_sha256)")
        names = [n for e in self.engines for n in e.names()]
        if dup := unique(names):
            raise ValueError(f"engines: names must be unique (a managed engine with launch.replicas > 1 "
                             f"is <name>-0, <name>-1, …); repeated: {dup}")
        if self.admission.ttft_budget_s > self.admission.max_ttft_budget_s:
            raise ValueError("admission.ttft_budget_s must not exceed admission.max_ttft_budget_s")
        return self

    def sim_engine_configs(self) -> tuple[SimEngineConfig, ...]:
        """The embedded fleet's engines as they run: the served model, and their KV-event sockets."""
        out = []
        for i, e in enumerate(self.sim.engines):
            update: dict[str, object] = {"model": self.model}
            if self.sim.kv_events and e.kv_events_endpoint is None:
                path = f"ipc:///tmp/narwhal-sim-kv-{self.sim.base_port + i}"
                update |= {"kv_events_endpoint": path, "kv_events_replay_endpoint": path + "-replay"}
            out.append(e.model_copy(update=update))
        return tuple(out)

    def resolved_engines(self) -> tuple[EngineConfig, ...]:
        """The configured engines, or the embedded simulated fleet when none are configured."""
        if self.engines:
            return self.engines
        return tuple(
            EngineConfig(
                name=e.name,
                url=f"http://{self.sim.host}:{self.sim.base_port + i}",
                role=e.role,
                dialect=e.dialect,
                max_num_seqs=e.max_num_seqs,
                priority_scheduling=e.priority_scheduling,
                kv_events=None if e.kv_events_endpoint is None else KVEventsEndpoint(
                    endpoint=e.kv_events_endpoint, replay_endpoint=e.kv_events_replay_endpoint),
            )
            for i, e in enumerate(self.sim_engine_configs())
        )


def format_validation_error(exc: Exception) -> str:
    """A one-line-per-problem message naming each offending key (for start-up errors)."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{loc}'")
        else:
            lines.append(f"config key '{loc}': {err['msg']}")
    return "invalid Narwhal config: " + "; ".join(lines)


# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "FAULT_NAMES": "sim",
    "SCRIPT_NAMES": "sim",
}
__all__ = [
    "AdminConfig", "AdmissionConfig", "DeploymentKnobs", "EngineConfig", "FAULT_NAMES", "HAConfig",
    "KVEventsEndpoint", "LaunchSpec", "LeaseConfig", "MonitoringConfig", "NarwhalConfig",
    "ObservabilityConfig", "PhaseConcurrency", "PlacementConfig", "PriorityClass", "SCRIPT_NAMES",
    "ServingConfig", "SimEngineConfig", "SimFleetConfig", "TenantSpec", "TenantsConfig",
    "format_validation_error", "slot_names",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.config.sim import FAULT_NAMES as FAULT_NAMES
    from narwhal_serve.config.sim import SCRIPT_NAMES as SCRIPT_NAMES
