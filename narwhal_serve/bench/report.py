"""Output of a bench run: aligned text tables, the JSON results, per-request JSONL, PNG plots."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from narwhal_serve.bench.stats import RequestResult

Cell = str | int | float | None


def fmt(v: Cell, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], nd: int = 2) -> str:
    cells = [[fmt(c, nd) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def run_dir(out: Path, mode: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = out / f"{mode}-{stamp}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    return path


def publish(out: Path, res: dict[str, Any], text: str, plots: Sequence[Path | str], *also: str) -> int:
    """Write ``res`` to ``out/results.json``, print the tables, where the results are (and ``also``)
    and every plot; the command's exit status (0)."""
    path = write_json(out / "results.json", res)
    print(text)
    print("\n".join([f"\nresults: {path}", *also]))
    for p in plots:
        print(f"plot: {p}")
    return 0


class RequestLog:
    """Appends every request's result, tagged with its run, to ``requests.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, tags: dict[str, Any], results: Sequence[RequestResult]) -> None:
        with self.path.open("a") as fh:
            for r in results:
                fh.write(json.dumps({**tags, **r.to_json()}) + "\n")


def check(name: str, value: float | None, op: str, threshold: float) -> dict[str, Any]:
    """One benchmark target: ``value op threshold`` (``<=``, ``<`` or ``>=``) → PASS / MISS
    (``n/a`` without a value)."""
    if value is None:
        verdict = "n/a"
    elif op == "<=":
        verdict = "PASS" if value <= threshold else "MISS"
    elif op == "<":
        verdict = "PASS" if value < threshold else "MISS"
    else:
        verdict = "PASS" if value >= threshold else "MISS"
    return {"check": name, "value": value, "op": op, "threshold": threshold, "verdict": verdict}


def checks_table(checks: Sequence[dict[str, Any]]) -> str:
    return table(["target", "value", "want", "verdict"],
                 [[c["check"], c["value"], f"{c['op']} {c['threshold']}", c["verdict"]] for c in checks], nd=3)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str,
               series: dict[str, list[tuple[float, float | None]]], log_y: bool = False) -> Path | None:
    """A line per series (Agg backend).  Returns None, printing why, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path.name} (pip install 'narwhal-serve[bench]')")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, pts in series.items():
        xs = [x for x, y in pts if y is not None]
        ys = [y for _, y in pts if y is not None]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
