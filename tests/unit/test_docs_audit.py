"""The reference documents agree with the code they describe, checked mechanically (no Ray, no servers).

* docs/configuration.md, "Configuration": every key of the typed args is documented, every key the
  table names exists, and every default it states is the code's (the inline ``name: default`` lists
  of a managed engine's launch spec and of a simulated engine too).
* docs/contract.md, "Errors": every error code the router can send is a row of the table, with the
  status and type the code gives it, and every row's code is one the router sends.
* docs/operations.md, "Metrics": the metric names listed are exactly the ones ``/metrics`` exports,
  with the labels stated; docs/contract.md, "Mid-stream resume": ``narwhal_resumes_total``'s reasons
  and outcomes are the relay's.
* docs/operations.md, "Logs and traces": the request log's example line has the line's fields;
  "Managed engines": every flag a managed engine's ``launch.args`` may not repeat is named.
* every YAML config example of the documents validates.
* docs/testing.md, "Simulator": the fault and script names are the simulator's; "Fault suite": the
  scenario count is the suite's.
* every ``narwhal-bench`` command the documents show parses with the CLI's own parser, and every
  ``make`` target they name is one of the Makefile's.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import subprocess
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{n}.md" for n in ("architecture", "configuration", "contract",
                                                                 "operations", "testing"))]


def _section(doc: str, heading: str) -> str:
    """The text of the section under ``heading`` (any level), up to the next heading of its level or above."""
    text = (ROOT / doc).read_text()
    m = re.search(rf"(?m)^(#+) {re.escape(heading)}\s*$", text)
    assert m is not None, f"{doc}: no heading {heading!r}"
    level = len(m.group(1))
    end = re.compile(rf"(?m)^#{{1,{level}}} ")
    nxt = end.search(text, m.end())
    return text[m.end():nxt.start() if nxt else len(text)]


# --- docs/configuration.md ------------------------------------------------------------------------


def _models(ann: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (``X | None``, ``tuple[X, ...]``)."""
    out, todo = [], [ann]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.append(t)
        todo.extend(typing.get_args(t))
    return out


def _config_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        out.append(prefix + name)
        for sub in _models(f.annotation):
            out += _config_paths(sub, prefix + name + ".")
    return out


def _table_rows() -> list[tuple[list[str], list[str]]]:
    """Each row of the configuration table: its keys as full dotted paths (``a.b`` / ``c`` is
    ``a.b`` and ``a.c``; ``a.b.c`` / ``.d`` is ``a.b.d``) and its default cell split the same way."""
    rows = []
    for line in _section("docs/configuration.md", "Configuration (`serve_config.yaml`, `applications[0].args`)").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        keys, base = [], ""
        for k in re.findall(r"`([^`]+)`", cells[0]):
            if k.startswith("."):
                k = base.rsplit(".", 1)[0] + k
            elif "." not in k and "." in base:
                k = base.rsplit(".", 1)[0] + "." + k
            if "." in k:
                base = k
            keys.append(k)
        rows.append((keys, re.split(r" / |, ", cells[1])))
    return rows


def _field(path: str) -> Any:
    """The pydantic field of a documented key (``engines[]`` reads as ``engines``)."""
    from narwhal_serve.config import NarwhalConfig

    model: Any = NarwhalConfig
    f = None
    for part in path.replace("[]", "").split("."):
        assert model is not None and part in model.model_fields, f"{path}: no such config key"
        f = model.model_fields[part]
        subs = _models(f.annotation)
        model = subs[0] if subs else None
    return f


def _doc_value(cell: str) -> Any:
    """A documented default as a value; ``...`` for a default the cell describes in words."""
    v = cell.strip().strip("`")
    if v in ("none",):
        return None
    if v in ("true", "false"):
        return v == "true"
    if v == "[]":
        return ()
    if re.fullmatch(r"-?\d+(\.\d+)?", v):
        return float(v)
    if re.fullmatch(r"[\w.:-]+", v) and cell.strip().startswith("`"):
        return v
    return ...


def test_every_config_key_is_in_the_configuration_table() -> None:
    from narwhal_serve.config import NarwhalConfig

    documented = {k.replace("[]", "") for keys, _ in _table_rows() for k in keys}
    text = _section("docs/configuration.md", "Configuration (`serve_config.yaml`, `applications[0].args`)")
    missing = []
    for path in _config_paths(NarwhalConfig):
        parts = path.split(".")
        if any(d.startswith(path + ".") for d in documented):
            continue  # a section: its keys are the rows
        # a section's own keys are rows of the table; keys of a list's items or of an object value
        # (engines[], a launch spec, a simulated engine, a tenant, the router lease) are named in their row
        if path in documented or any(".".join(parts[:i]) in documented for i in range(1, len(parts))):
            if path in documented or re.search(rf"(?<![\w.]){re.escape(parts[-1])}(?!\w)", text):
                continue
        missing.append(path)
    assert missing == [], f"config keys docs/configuration.md does not document: {missing}"


def test_every_documented_config_key_exists_with_the_stated_default() -> None:
    wrong = []
    for keys, defaults in _table_rows():
        for k in keys:
            _field(k)  # exists
        if len(keys) != len(defaults):
            continue  # a default described in words
        for k, cell in zip(keys, defaults):
            want = _doc_value(cell)
            if want is ...:
                continue
            f = _field(k)
            have = f.default if not f.is_required() else ...
            if isinstance(have, BaseModel) or have is ...:
                continue
            if isinstance(want, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
                ok = float(have) == want
            else:
                ok = have == want or (want is None and have == ())  # (`none`: an empty list)
            if not ok:
                wrong.append(f"{k}: documented {cell!r}, code {have!r}")
    assert wrong == [], "\n".join(wrong)


def _inline_defaults(row_key: str) -> dict[str, str]:
    """``name: value`` pairs of one configuration row's meaning cell (a nested ``{...}`` flattened)."""
    for line in _section("docs/configuration.md", "Configuration (`serve_config.yaml`, `applications[0].args`)").splitlines():
        if line.startswith(f"| `{row_key}`"):
            meaning = line.strip().strip("|").split(" | ")[2]
            return dict(re.findall(r"(?<![\w.])([a-z_]+): ([\w./:|\\-]+)", meaning))
    raise AssertionError(f"no row {row_key}")


def test_inline_defaults_of_a_launch_spec_and_a_simulated_engine() -> None:
    from narwhal_serve.config import LaunchSpec, SimEngineConfig
    from narwhal_serve.config.launch import Resources

    wrong = []
    for row, models in (("engines[].launch", (LaunchSpec, Resources)),
                        ("sim.host", (SimEngineConfig,)),
                        ("ha.lease", (type(_field("ha.lease").default),))):
        pairs = _inline_defaults(row)
        assert pairs, row
        for name, value in pairs.items():
            f = next((m.model_fields[name] for m in models if name in m.model_fields), None)
            if f is None or f.is_required() or "|" in value or value in ("redis", "none"):
                continue  # a key shown with its choices, or the example backend
            have = f.default
            try:
                ok = (float(have) == float(value) if not isinstance(have, (str, bool))
                      else str(have).lower() == value if isinstance(have, bool) else have == value)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                wrong.append(f"{row}: {name}: documented {value!r}, code {have!r}")
    assert wrong == [], "\n".join(wrong)


# --- docs/contract.md, "Errors" -------------------------------------------------------------------

# never sent to a client: the scheduler's answer to a queued request whose client left (the ingress
# counts the cancellation), and the base class's code (every RateLimited carries its own)
_NOT_SENT = {"cancelled", "rate_limited"}


def _error_classes() -> dict[str, type]:
    import narwhal_serve.errors as errors

    classes = {n: c for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, errors.NarwhalError)}
    for p in _router_sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in classes for b in node.bases):
                mod = importlib.import_module(".".join(p.relative_to(ROOT).with_suffix("").parts))
                classes[node.name] = getattr(mod, node.name)
    return classes


@cache
def _router_sources() -> tuple[Path, ...]:
    """The router's code (not the simulator, the benchmarks or the replay tool)."""
    skip = ("sim", "bench", "replay")
    return tuple(p for p in sorted((ROOT / "narwhal_serve").rglob("*.py"))
                 if p.relative_to(ROOT / "narwhal_serve").parts[0] not in skip)


def _codes_sent() -> dict[str, set[tuple[int, str]]]:
    """Every error code the router's code gives, with the (status, type) it gives it: class codes,
    ``code=`` literals and names bound to literals, ``ErrorInfo(status, type, code, …)`` literals,
    the predictive refusals' codes, and the unknown route / method handler's."""
    classes = _error_classes()
    out: dict[str, set[tuple[int, str]]] = {}
    for c in classes.values():
        if "code" in c.__dict__:
            out.setdefault(c.code, set()).add((c.status, c.type))
    for p in _router_sources():
        tree = ast.parse(p.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                  for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name in classes:
                for kw in node.keywords:
                    v = kw.value
                    code = v.value if isinstance(v, ast.Constant) else consts.get(v.id) if isinstance(v, ast.Name) else None
                    if kw.arg == "code" and isinstance(code, str):
                        out.setdefault(code, set()).add((classes[name].status, classes[name].type))
            if name == "ErrorInfo" and len(node.args) >= 3 and all(isinstance(a, ast.Constant) for a in node.args[:3]):
                status, type_, code = (a.value for a in node.args[:3])  # type: ignore[attr-defined]
                out.setdefault(code, set()).add((status, type_))
            if name == "_refused" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                out.setdefault(node.args[1].value, set()).add((429, "rate_limit_error"))  # admission/predictive.py
    app = (ROOT / "narwhal_serve" / "gateway" / "app.py").read_text()
    m = re.search(r'\{404: "(\w+)", 405: "(\w+)"\}', app)
    assert m is not None, "gateway/app.py: the unknown route / method codes moved"
    out.setdefault(m.group(1), set()).add((404, "invalid_request_error"))
    out.setdefault(m.group(2), set()).add((405, "invalid_request_error"))
    return {k: v for k, v in out.items() if k not in _NOT_SENT}


def _error_table() -> list[tuple[list[str], str, list[str]]]:
    """(statuses, type, codes) of each row of the Errors table."""
    rows = []
    for line in _section("docs/contract.md", "Errors").splitlines():
        if not line.startswith("| ") or line.startswith("| condition") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        status, type_, code = cells[-4], cells[-3], cells[-2]
        rows.append((re.findall(r"\d{3}", status) if "error event" not in status else
                     [*re.findall(r"\d{3}", status.split("(")[0]), "event"], type_, [c.strip() for c in code.split("/")]))
    return rows


def test_every_error_code_the_router_sends_is_in_the_table_with_its_status_and_type() -> None:
    sent = _codes_sent()
    table: dict[str, set[tuple[str, str]]] = {}
    for statuses, type_, codes in _error_table():
        for i, code in enumerate(codes):
            mine = [statuses[i]] if len(codes) == len(statuses) else statuses
            table.setdefault(code, set()).update((s, type_) for s in mine)
    missing = sorted(set(sent) - set(table))
    assert missing == [], f"codes the router sends that docs/contract.md, \"Errors\" does not list: {missing}"
    unknown = sorted(set(table) - set(sent))
    assert unknown == [], f"codes docs/contract.md, \"Errors\" lists that nothing sends: {unknown}"
    wrong = []
    for code, given in sorted(sent.items()):
        for status, type_ in given:
            if not any((s == str(status) or s == "event") and t == type_ for s, t in table[code]):
                wrong.append(f"{code}: the code sends {status} {type_}, the table says {sorted(table[code])}")
    assert wrong == [], "\n".join(wrong)


def test_every_counted_reason_is_a_documented_code_or_reason() -> None:
    """/metrics exports each terminal class with each reason it is documented to use (docs/operations.md,
    "Metrics"): each is an error code of the table, or a reason the contract names."""
    from narwhal_serve.protocol.outcomes import KNOWN_REASONS

    table = {c for _, _, codes in _error_table() for c in codes}
    contract = (ROOT / "docs" / "contract.md").read_text()
    stray = sorted(r for reasons in KNOWN_REASONS.values() for r in reasons
                   if r not in table and not re.search(rf"(?<![\w.]){r}(?![\w.])", contract))
    assert stray == []


# --- docs/operations.md, "Metrics" ----------------------------------------------------------------


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([a-z_,]+)\}", name)
    if m is None:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _documented_metrics() -> dict[str, set[str] | None]:
    """Metric name → its documented labels (None: none stated), from the Metrics section."""
    text = _section("docs/operations.md", "Metrics").split("### Dashboard")[0]
    out: dict[str, set[str] | None] = {}
    for span in re.findall(r"`(narwhal_[a-z_{},\s]+)`", text):
        span = re.sub(r"\s+", "", span)
        labels = None
        m = re.fullmatch(r"(.*[^_])\{([a-z_,]+)\}", span)
        if m is not None:
            span, labels = m.group(1), set(m.group(2).split(","))
        for name in _expand(span):
            out[name] = labels
    return out


def _exported_metrics() -> dict[str, set[str]]:
    """Metric family → the label names of its samples, from a scheduler's /metrics text (three
    engines, a budgeted tenant)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.scheduler import scheduler_service

    svc, _ = scheduler_service({}, tenants={"list": [{"name": "acme", "requests_per_minute": 60,
                                                      "input_tokens_per_minute": 1000}]})
    text = svc.metrics_text()
    families = set(re.findall(r"(?m)^# TYPE (\S+)", text))
    out: dict[str, set[str]] = {f: set() for f in families}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = next((f for f in families if s.name == f or s.name.startswith(f + "_")
                         and s.name[len(f):] in ("_bucket", "_sum", "_count", "_total", "_created")), s.name)
            out.setdefault(name, set()).update(k for k in s.labels if k != "le")
    return out


def test_the_metrics_section_lists_exactly_the_exported_metrics_with_their_labels() -> None:
    documented, exported = _documented_metrics(), _exported_metrics()
    assert sorted(set(exported) - set(documented)) == [], "exported, not in docs/operations.md, \"Metrics\""
    assert sorted(set(documented) - set(exported)) == [], "in docs/operations.md, \"Metrics\", not exported"
    wrong = [f"{n}: documented {sorted(labels)}, exported {sorted(exported[n])}"
             for n, labels in documented.items() if labels is not None and exported[n] and labels != exported[n]]
    assert wrong == [], "\n".join(wrong)


# --- docs/operations.md, "Logs and traces" --------------------------------------------------------


def test_the_request_log_example_has_the_lines_fields() -> None:
    text = _section("docs/operations.md", "Logs and traces")
    example = json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))  # type: ignore[union-attr]
    tree = ast.parse((ROOT / "narwhal_serve" / "observability.py").read_text())
    fields = next(n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                  and isinstance(n.target, ast.Name) and n.target.id == "fields")
    assert isinstance(fields, ast.Dict)
    keys = [k.value for k in fields.keys if isinstance(k, ast.Constant)]
    assert list(example) == keys


# --- docs/testing.md ------------------------------------------------------------------------------


def test_the_simulators_fault_and_script_names() -> None:
    from narwhal_serve.config.sim import FAULT_NAMES, SCRIPT_NAMES

    text = _section("docs/testing.md", "Simulator")
    m = re.search(r'"script": "([^"]+)"', text)
    assert m is not None and set(m.group(1).split("|")) == SCRIPT_NAMES
    faults = text[text.index("injects faults"):text.index("POST /sim/control")]
    assert set(re.findall(r"`([a-z0-9_]+)`", faults)) - {"retry_after_s"} == FAULT_NAMES


@cache
def _fault_scenarios() -> int:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/fault"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    m = re.search(r"(\d+) tests? collected", out.stdout)
    assert m is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return int(m.group(1))


def test_the_fault_suite_count_in_docs_testing() -> None:
    m = re.search(r"injects faults in (\d+) scenarios", _section("docs/testing.md", "Fault suite"))
    assert m is not None
    assert int(m.group(1)) == _fault_scenarios()


def test_the_fault_suite_count_in_the_makefile() -> None:
    m = re.search(r"\): (\d+) fault scenarios", (ROOT / "Makefile").read_text())
    assert m is not None
    assert int(m.group(1)) == _fault_scenarios(), "the Makefile's comment on test-fault counts another suite"


# --- commands -------------------------------------------------------------------------------------


def test_every_narwhal_bench_command_shown_parses() -> None:
    from narwhal_serve.bench.cli import build_parser

    parser, bad, seen = build_parser(), [], 0
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        spans += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for span in spans:
            for m in re.finditer(r"narwhal-bench ([a-z].*)", span.replace("\n", " ")):
                seen += 1
                try:
                    parser.parse_args(shlex.split(m.group(1)))
                except SystemExit:
                    bad.append(f"{doc.relative_to(ROOT)}: narwhal-bench {m.group(1)}")
    assert seen > 5 and bad == [], "\n".join(bad)


def test_every_make_target_named_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"(?m)^([a-z][\w-]*):", makefile))
    named = {t for doc in DOCS for t in re.findall(r"`make ([a-z][\w-]*)", doc.read_text())}
    assert named and sorted(named - targets) == []


def test_every_flag_narwhal_owns_on_a_managed_engines_command_line_is_named() -> None:
    """docs/operations.md, "Managed engines": the flags ``launch.args`` may not repeat."""
    from narwhal_serve.config.launch import _OWNED_FLAGS

    text = re.sub(r"```.*?```", "", _section("docs/operations.md", "Managed engines"), flags=re.S)
    named = {f for span in re.findall(r"`([^`]+)`", text) for f in span.split("/")}
    missing = sorted(f for flags in _OWNED_FLAGS.values() for f in flags if f not in named)
    assert missing == []


def test_every_config_example_validates() -> None:
    """Each YAML example of the documents (a serve config, its ``args``, or a section of them) is a
    config the router starts with."""
    import yaml

    from narwhal_serve.config import NarwhalConfig

    seen = 0
    for doc in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S):
            data = yaml.safe_load(block)
            args = (data["applications"][0]["args"] if "applications" in data
                    else data["args"] if "args" in data else data)
            NarwhalConfig.model_validate(args)
            seen += 1
    assert seen >= 4


def test_the_resume_counters_labels() -> None:
    """docs/contract.md, "Mid-stream resume": ``narwhal_resumes_total``'s reasons and outcomes."""
    from narwhal_serve.relay.messages import RESUME_OUTCOMES, RESUME_REASONS

    text = re.sub(r"\s+", " ", _section("docs/contract.md", "Mid-stream resume"))
    m = re.search(r"`reason` is (.*?); `outcome` is (.*?) \(a breaker cut", text)
    assert m is not None
    assert set(re.findall(r"`(\w+)`", m.group(1))) == set(RESUME_REASONS)
    assert set(re.findall(r"`(\w+)`", m.group(2))) == set(RESUME_OUTCOMES)
