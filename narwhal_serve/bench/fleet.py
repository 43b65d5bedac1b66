"""The bench's targets over one shared engine fleet, all on 127.0.0.1 free ports:

* ``direct``: the engines themselves (client-side round-robin over several);
* ``proxy`` / ``rr``: :mod:`narwhal_serve.bench.proxy` round-robin over the engines (with one engine
  it is the bare single-upstream pass-through; both names use the same process);
* ``narwhal-open`` / ``narwhal-predictive``: one ``serve run`` hosting both as two applications
  (route prefixes ``/open`` and ``/predictive``) so they share one Ray instance, with ``engines:``
  naming the bench's fleet (role unified, dialect vllm);
* ``narwhal-prefix-blind``: ``narwhal-predictive`` with ``placement.prefix_aware: false``
  (``/prefix-blind``), the baseline of prefix-aware placement;
* ``narwhal-predictive-2``: ``narwhal-predictive`` on two ingress replicas (two leases), and
  ``narwhal-predictive-2-nowatch`` the same with ``admission.lease_watch: false``;
* ``<narwhal target>@base`` (``--baseline-tree DIR``): the same application served by a second
  ``serve run`` (its own Ray instance) from another checkout of the repository, e.g. a
  ``git worktree`` of the commit before a change: two builds side by side in one run.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal_serve.bench import procs
from narwhal_serve.config import ServingConfig
from narwhal_serve.runenv import RUN_ENV, IngressLimits, direct_ingress_env
from narwhal_serve.bench.client import Endpoint

BASE = "@base"


def base_of(target: str) -> str | None:
    """The Narwhal target a ``<target>@base`` names, else None."""
    return target[: -len(BASE)] if target.endswith(BASE) and target[: -len(BASE)] in NARWHAL_PREFIX else None


def known_target(target: str) -> bool:
    return target in TARGETS or base_of(target) is not None


TARGETS: tuple[str, ...] = ("direct", "proxy", "narwhal-open", "narwhal-predictive", "rr", "narwhal-nolease",
                            "narwhal-prefix-blind", "narwhal-estimate", "narwhal-assembler", "narwhal-tenants",
                            "narwhal-tenants-3", "narwhal-predictive-2", "narwhal-predictive-2-nowatch")
# narwhal-nolease: open admission with a scheduler call per request (admission.ingress_leases off)
# and plain httpx to the engines — the hot path before leases, measured beside the others
# narwhal-assembler: predictive, with engine streams relayed by the Assembler deployment (a Ray
# hop) instead of in the ingress
# narwhal-tenants: predictive, with keyed tenants (bench/tenants.py); narwhal-tenants-3: the same with
# three ingress replicas (a budget must hold across them)
# narwhal-estimate: predictive, with prompts sized by the characters / 4 estimate and the prefix index
# learned from placements (no tokenizer, no KV events) — the router before exact tokens, side by side
NARWHAL_PREFIX = {"narwhal-open": "/open", "narwhal-predictive": "/predictive", "narwhal-nolease": "/nolease",
                  "narwhal-prefix-blind": "/prefix-blind", "narwhal-estimate": "/estimate",
                  "narwhal-assembler": "/assembler", "narwhal-tenants": "/tenants", "narwhal-tenants-3": "/tenants-3",
                  "narwhal-predictive-2": "/predictive-2", "narwhal-predictive-2-nowatch": "/predictive-2-nowatch"}
PREDICTIVE_TARGETS = frozenset({"narwhal-predictive", "narwhal-prefix-blind", "narwhal-estimate", "narwhal-assembler",
                                "narwhal-tenants", "narwhal-tenants-3", "narwhal-predictive-2",
                                "narwhal-predictive-2-nowatch"})
RAY_ENV = {
    **RUN_ENV,  # direct ingress, the run mode (--ray-env RAY_SERVE_ENABLE_HA_PROXY=0: the proxy actor)
    "RAY_ADDRESS": "local",  # never join another Ray instance on this machine
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}
RAY_DEFAULT_NICENESS = 15  # Ray starts its workers at nice 15 unless RAY_worker_niceness says otherwise


def bench_serve_env(log_dir: Path, extra: Iterable[tuple[str, str]] = (), **more: str) -> dict[str, str]:
    """A benchmark's ``serve run`` environment: the run mode's (:data:`RAY_ENV`, direct ingress
    with the HAProxy wrapper), this run's own HAProxy ports (away from a ``make run`` on the same
    machine), then ``more``; ``extra`` (the command's ``--ray-env``) wins."""
    env = {**RAY_ENV,
           "RAY_SERVE_HAPROXY_STATS_PORT": str(procs.free_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(procs.free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(procs.free_port()),
           **more, **dict(extra)}
    if env["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        # the benchmark's applications keep the serving defaults
        env = direct_ingress_env(env, IngressLimits.of([ServingConfig()]), str(log_dir / "haproxy-bin"))
    return env


def tree_wrapper(tree: Path, folder: Path, fallback: str) -> str:
    """The HAProxy wrapper as the build in ``tree`` writes it: its rules are part of that build (a
    baseline behind this build's wrapper would be measured with this build's HAProxy rules).
    ``fallback`` (this build's) where that build cannot write one."""
    code = ("import sys; from narwhal_serve.config import ServingConfig; "
            "from narwhal_serve.runenv import IngressLimits, haproxy_wrapper; "
            "print(haproxy_wrapper(IngressLimits.of([ServingConfig()]), sys.argv[1]) or '')")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=tree, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(tree)}, timeout=60, check=False)
        path, why = (out.stdout.strip().splitlines() or [""])[-1] if out.returncode == 0 else "", out.stderr.strip()[-200:]
    except (OSError, subprocess.SubprocessError) as exc:
        path, why = "", str(exc)
    if not path:
        print(f"WARNING: {tree} wrote no HAProxy wrapper ({why}); its build runs behind this one's", flush=True)
        return fallback
    return path


@dataclass(frozen=True)
class SimTiming:
    """Timing model of every simulated engine (see ``narwhal_serve.sim.timing``)."""

    prefill_overhead_s: float = 0.002
    prefill_per_token_s: float = 0.00002
    tpot_base_s: float = 0.002
    tpot_per_running_s: float = 0.0
    max_num_seqs: int = 256
    max_model_len: int = 65536  # room for real traces' prompts (Mooncake's run to tens of thousands)

    def argv(self) -> list[str]:
        return ["--prefill-overhead-s", str(self.prefill_overhead_s), "--prefill-per-token-s",
                str(self.prefill_per_token_s), "--tpot-base-s", str(self.tpot_base_s), "--tpot-per-running-s",
                str(self.tpot_per_running_s), "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len)]

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_overhead_s + self.prefill_per_token_s * tokens

    def tpot_s(self, running: float) -> float:
        return self.tpot_base_s + self.tpot_per_running_s * running


@dataclass(frozen=True)
class FleetSpec:
    engines: int = 1
    timing: SimTiming = SimTiming()
    model: str = "narwhal-sim"
    external_urls: tuple[str, ...] = ()  # --engine-url: use these instead of simulated engines
    narwhal_budget_s: float = 2.0  # admission.ttft_budget_s (clients also send X-TTFT-Target)
    ray_niceness: int = 0  # Ray workers' nice level; 0 = same priority as the engines, proxy and clients
    ray_env: tuple[tuple[str, str], ...] = ()  # extra environment for `serve run`
    tokenizer: str | None = None  # --tokenizer: the external engines' model directory (exact prompt sizes)
    baseline_tree: Path | None = None  # --baseline-tree: the checkout serving the `<target>@base` targets


TENANT_KEYS = {"a": "bench-tenant-a", "b": "bench-tenant-b", "c": "bench-tenant-c"}  # narwhal-tenants' tenants
BUDGET_RPM = 30.0  # tenant c's requests per minute (bench/tenants.py, the budget scenario): at 10x, 5 req/s, under the
# default fleet's SLO capacity (~7.5 req/s), so that the budget binds, not the fleet
TENANT_INGRESS_REPLICAS = 3  # narwhal-tenants runs this many ingress replicas: budgets must hold across them


def tenants_config() -> dict[str, Any]:
    """The ``tenants`` section of the ``narwhal-tenants`` target: keyed tenants a and b (equal
    weights, no budgets) and c (``BUDGET_RPM`` requests per minute)."""
    return {"list": [{"name": t, "key_sha256": [hashlib.sha256(k.encode()).hexdigest()],
                      **({"requests_per_minute": BUDGET_RPM} if t == "c" else {})} for t, k in TENANT_KEYS.items()]}


def narwhal_app(args: dict[str, Any], name: str = "narwhal", route_prefix: str = "/") -> dict[str, Any]:
    """One Narwhal application of a ``serve run`` config (``args``: :class:`NarwhalConfig` fields)."""
    return {"name": name, "route_prefix": route_prefix, "import_path": "deployments.app:build_app", "args": args}


def serve_config(port: int, apps: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``serve run`` config: ``apps`` behind Serve's HTTP port ``port`` on 127.0.0.1."""
    return {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": apps}


def kv_events_of(port: int) -> dict[str, str]:
    """A simulated engine's KV-event sockets (Unix sockets named after its HTTP port)."""
    base = f"ipc:///tmp/narwhal-bench-kv-{port}"
    return {"endpoint": base, "replay_endpoint": base + "-replay"}


def narwhal_serve_config(port: int, engine_urls: list[str], model: str, targets: list[str],
                         ttft_budget_s: float, max_num_seqs: int | None = None,
                         tokenizer: str | None = None, kv_events: bool = False) -> dict[str, Any]:
    """The ``serve run`` config: one application per selected Narwhal target.

    ``max_num_seqs``: the engines' slot count, as an operator would configure it (None for
    external engines whose limit the bench does not know).  ``tokenizer``: the model's (the
    simulator's for a simulated fleet); ``kv_events``: the engines publish them (simulated ones do)."""
    engines: list[dict[str, Any]] = [
        {"name": f"e{i}", "url": u, "role": "unified", "dialect": "vllm"} for i, u in enumerate(engine_urls)
    ]
    if max_num_seqs is not None:
        for e in engines:
            e["max_num_seqs"] = max_num_seqs
    apps = []
    for t in targets:
        mode = "predictive" if t in PREDICTIVE_TARGETS else "open"
        exact = t != "narwhal-estimate"
        app_engines = [{**e, "kv_events": kv_events_of(int(e["url"].rsplit(":", 1)[1]))} if kv_events and exact else e
                       for e in engines]
        apps.append(narwhal_app({
            "model": model,
            **({"tokenizer": tokenizer if exact else "estimate"} if tokenizer else {}),
            "admission": {"mode": mode, "ttft_budget_s": ttft_budget_s,
                          "max_ttft_budget_s": max(60.0, ttft_budget_s),
                          "ingress_leases": t != "narwhal-nolease",
                          **({"lease_watch": False} if t == "narwhal-predictive-2-nowatch" else {})},
            "engines": app_engines,
            **({"deployment": {"engine_http": "httpx"}} if t == "narwhal-nolease" else {}),
            **({"deployment": {"relay": "assembler"}} if t == "narwhal-assembler" else {}),
            **({"placement": {"prefix_aware": False}} if t == "narwhal-prefix-blind" else {}),
            **({"tenants": tenants_config()} if t in ("narwhal-tenants", "narwhal-tenants-3") else {}),
            **({"deployment": {"ingress_min_replicas": TENANT_INGRESS_REPLICAS,
                               "ingress_max_replicas": TENANT_INGRESS_REPLICAS}} if t == "narwhal-tenants-3" else {}),
            **({"deployment": {"ingress_min_replicas": 2, "ingress_max_replicas": 2}}
               if t.startswith("narwhal-predictive-2") else {}),
        }, t, NARWHAL_PREFIX[t]))
    return serve_config(port, apps)


def app_dir() -> Path:
    """The repository root holding ``deployments/`` (``serve run`` imports it from there)."""
    import narwhal_serve

    root = Path(narwhal_serve.__file__).resolve().parents[1]
    return root if (root / "deployments").is_dir() else Path.cwd()


@dataclass
class Fleet:
    spec: FleetSpec
    log_dir: Path
    engine_urls: list[str] = field(default_factory=list)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    sims: list[procs.Managed] = field(default_factory=list)
    proxy: procs.Managed | None = None
    narwhal: procs.Managed | None = None
    baseline: procs.Managed | None = None  # the `serve run` of --baseline-tree
    narwhal_startup_s: float | None = None

    @property
    def simulated(self) -> bool:
        return not self.spec.external_urls

    def start(self, targets: list[str], narwhal_timeout_s: float = 180.0) -> None:
        """Start the engines, then (in parallel where possible) the proxy and Narwhal; wait ready."""
        try:
            self._start(targets, narwhal_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, targets: list[str], narwhal_timeout_s: float) -> None:
        self.log_dir = self.log_dir.resolve()  # a `serve run` of --baseline-tree starts in another directory
        self.log_dir.mkdir(parents=True, exist_ok=True)  # also when no simulated engine is started
        if self.simulated:
            for i in range(self.spec.engines):
                port = procs.free_port()
                kv = kv_events_of(port)
                argv = procs.python_module("narwhal_serve.sim.cli", "--port", str(port), "--name", f"sim{i}",
                                           "--role", "unified", "--model", self.spec.model, "--seed", str(i),
                                           "--eos-prob", "0", *self.spec.timing.argv(),
                                           "--kv-events-endpoint", kv["endpoint"],
                                           "--kv-events-replay-endpoint", kv["replay_endpoint"])
                self.sims.append(procs.start(f"sim{i}", argv, self.log_dir))
                self.engine_urls.append(f"http://127.0.0.1:{port}")
            for url, p in zip(self.engine_urls, self.sims):
                procs.wait_ready(url + "/health", 30.0, p)
        else:
            self.engine_urls = list(self.spec.external_urls)
        nw_targets = [t for t in targets if t in NARWHAL_PREFIX]
        base_targets = [b for b in map(base_of, targets) if b is not None]
        started: list[tuple[procs.Managed, int, list[str], str]] = []
        if nw_targets:
            self.narwhal, port = self._serve_run("narwhal", nw_targets, app_dir())
            started.append((self.narwhal, port, nw_targets, ""))
        if base_targets:
            if self.spec.baseline_tree is None:
                raise ValueError("the @base targets need --baseline-tree")
            self.baseline, port = self._serve_run("baseline", base_targets, self.spec.baseline_tree.resolve())
            started.append((self.baseline, port, base_targets, BASE))
        if "proxy" in targets or "rr" in targets:
            port = procs.free_port()
            argv = procs.python_module("narwhal_serve.bench.proxy", "--port", str(port),
                                       *[a for u in self.engine_urls for a in ("--upstream", u)])
            self.proxy = procs.start("proxy", argv, self.log_dir)
            procs.wait_ready(f"http://127.0.0.1:{port}/health", 30.0, self.proxy)
            for t in ("proxy", "rr"):
                self.endpoints[t] = Endpoint(t, (f"http://127.0.0.1:{port}",))
        self.endpoints["direct"] = Endpoint("direct", tuple(self.engine_urls))
        t0 = time.monotonic()
        for proc, port, names, suffix in started:
            for t in names:
                base = f"http://127.0.0.1:{port}{NARWHAL_PREFIX[t]}"
                procs.wait_ready(base + "/ready", max(5.0, narwhal_timeout_s - (time.monotonic() - t0)), proc)
                self.endpoints[t + suffix] = Endpoint(t + suffix, (base,))
            proc.remember_tree()
        if started:
            self.narwhal_startup_s = time.monotonic() - t0

    def _serve_run(self, name: str, targets: list[str], tree: Path) -> tuple[procs.Managed, int]:
        """``serve run`` of one application per target, importing ``deployments`` and
        ``narwhal_serve`` from ``tree`` (PYTHONPATH first: it wins over the installed package)."""
        port = procs.free_port()
        cfg_path = (self.log_dir / f"{name}-serve-config.yaml").resolve()  # JSON is YAML; cwd is `tree`
        cfg_path.write_text(json.dumps(narwhal_serve_config(
            port, self.engine_urls, self.spec.model, targets, self.spec.narwhal_budget_s,
            None if self.spec.external_urls else self.spec.timing.max_num_seqs,
            tokenizer="narwhal-sim" if self.simulated else self.spec.tokenizer,
            kv_events=self.simulated), indent=1))
        env = self._ray_env()
        if tree != app_dir():
            env["PYTHONPATH"] = str(tree) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            if "RAY_SERVE_HAPROXY_BINARY_PATH" in env and "RAY_SERVE_HAPROXY_BINARY_PATH" not in dict(self.spec.ray_env):
                env["RAY_SERVE_HAPROXY_BINARY_PATH"] = tree_wrapper(tree, self.log_dir / f"{name}-haproxy-bin",
                                                                    env["RAY_SERVE_HAPROXY_BINARY_PATH"])
        serve = Path(sys.executable).parent / "serve"
        return procs.start(name, [str(serve), "run", str(cfg_path)], self.log_dir, env=env, cwd=tree), port

    def process(self, target: str) -> procs.Managed | None:
        """The process tree serving ``target`` (None for ``direct``)."""
        if base_of(target) is not None:
            return self.baseline
        if target in NARWHAL_PREFIX:
            return self.narwhal
        return self.proxy if target in ("proxy", "rr") else None

    def _ray_env(self) -> dict[str, str]:
        return bench_serve_env(self.log_dir, self.spec.ray_env, RAY_worker_niceness=str(self.spec.ray_niceness))

    def settle(self, timeout_s: float = 15.0) -> bool:
        """Wait until every simulated engine is idle (nothing running or waiting); bounded."""
        if not self.simulated:
            time.sleep(1.0)
            return True
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if all(sim_idle(u) for u in self.engine_urls):
                return True
            time.sleep(0.2)
        return False

    def reset_caches(self, num_gpu_blocks: int) -> None:
        """Empty every simulated engine's prefix cache and bound it to ``num_gpu_blocks`` blocks
        (no-op for external engines)."""
        if not self.simulated:
            return
        import urllib.request

        body = json.dumps({"clear_prefix_cache": True, "num_gpu_blocks": num_gpu_blocks}).encode()
        for u in self.engine_urls:
            req = urllib.request.Request(u + "/sim/control", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5.0) as resp:  # noqa: S310 (127.0.0.1)
                resp.read()

    def sim_counters(self) -> list[tuple[float, float, float]]:
        """Per simulated engine: (generation requests received, prefix-cache queried tokens, hit
        tokens), cumulative; empty for external engines."""
        return [_sim_counters(u) for u in self.engine_urls] if self.simulated else []

    def stop(self) -> None:
        for nw in (self.narwhal, self.baseline):
            if nw is not None:
                nw.stop(first=signal.SIGINT, grace_s=20.0, term_s=10.0)  # SIGINT: serve run shuts Ray down
        if self.proxy is not None:
            self.proxy.stop()
        for p in self.sims:
            p.stop()


def sim_idle(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/sim/stats", timeout=2.0) as resp:  # noqa: S310 (127.0.0.1)
            st = json.loads(resp.read())
        return int(st.get("running", 1)) == 0 and int(st.get("waiting", 1)) == 0
    except (OSError, ValueError):
        return False


def _sim_counters(url: str) -> tuple[float, float, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/sim/stats", timeout=5.0) as resp:  # noqa: S310 (127.0.0.1)
        requests = float(json.loads(resp.read()).get("total_requests", 0))
    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as resp:  # noqa: S310 (127.0.0.1)
        text = resp.read().decode()
    return (requests, prom_value(text, "vllm:prefix_cache_queries_total"),
            prom_value(text, "vllm:prefix_cache_hits_total"))


def prom_value(text: str, name: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus text exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
