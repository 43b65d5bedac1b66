"""narwhal-bench decision: a lease admission and the scheduler's decide, timed on a synthetic fleet."""

from pathlib import Path

from narwhal_serve.bench import decision


def test_measures_both_paths_and_writes_json(tmp_path: Path) -> None:
    rows = decision.run(tmp_path, [3, 8], 200)
    assert [r["engines"] for r in rows] == [3, 8]
    for r in rows:
        for k in ("lease_admission", "scheduler_decide"):
            p = r[k]
            assert isinstance(p, dict) and 0 < p["p50_us"] <= p["p99_us"]
    assert (tmp_path / "results.json").exists()


def test_with_tenants_the_lease_still_decides_locally(tmp_path: Path) -> None:
    rows = decision.run(tmp_path, [3], 300, [0, 20])
    assert [(r["engines"], r["tenants"]) for r in rows] == [(3, 0), (3, 20)]
    with_tenants = rows[1]
    # every tenant holds a share after the first grants: no request of the timed loop asks the scheduler
    assert with_tenants["deferred_to_scheduler"] == 0
