import numpy as np

from narwhal_serve.admission.predictive import judge
from narwhal_serve.prediction.ttft import PRIOR_A, PRIOR_B, PrefillModel, Projection, project


def test_fit_recovers_a_linear_engine() -> None:
    m = PrefillModel()
    assert (m.a, m.b) == (PRIOR_A, PRIOR_B)
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = float(rng.integers(10, 4000))
        m.observe(x, 0.004 + 0.00003 * x + float(rng.normal(0, 0.0005)))
    assert abs(m.a - 0.004) < 0.002 and abs(m.b - 0.00003) < 0.000005
    p = project(m, pending_tokens=3000, prompt_tokens=100)
    assert p.prompt_alone_s < p.projected_s and abs(p.projected_s - m.predict(3100)) < 1e-12


def test_judge_rows() -> None:
    assert judge(Projection(0.5, 1.5), 2.0) is None
    alone = judge(Projection(2.5, 3.0), 2.0)
    assert alone is not None and alone.error.code == "prompt_exceeds_ttft_budget" and alone.error.retry_after is None
    assert "shorten the prompt or raise the target" in alone.error.message
    over = judge(Projection(0.5, 5.7), 2.0)
    assert over is not None and over.error.code == "ttft_budget_exceeded" and over.error.retry_after == 4
    small = judge(Projection(0.5, 2.1), 2.0)
    assert small is not None and small.error.retry_after == 1  # at least 1 s
    assert over.outcome.value == "refused" and over.error.status == 429
    # waiting cures the second row, not the first: OpenAI's SDKs are told not to retry that one
    assert alone.error.headers().get("x-should-retry") == "false" and "Retry-After" not in alone.error.headers()
    assert "x-should-retry" not in over.error.headers() and over.error.headers()["Retry-After"] == "4"
    tiny = judge(Projection(0.0004, 0.0004), 0.0001)
    assert tiny is not None and "needs about 0.0004 s to first token, over the 0.0001 s TTFT budget" in tiny.error.message


def test_noisy_short_prompts_do_not_extrapolate_wildly() -> None:
    m = PrefillModel()
    rng = np.random.default_rng(1)
    for _ in range(100):  # only short prompts, very noisy TTFTs (a loaded machine)
        x = float(rng.integers(5, 40))
        m.observe(x, 0.05 + float(abs(rng.normal(0, 0.2))))
    assert m.predict(2500) < 10 * m.predict(20)


def test_slot_wait() -> None:
    from narwhal_serve.prediction.ttft import slot_wait_s

    assert slot_wait_s(3, 4, 1.0) == 0.0  # a free slot
    assert slot_wait_s(4, 4, 1.0) == 0.25  # one ahead of the slots: a quarter of a service time
    assert slot_wait_s(11, 4, 2.0) == 4.0
    assert slot_wait_s(100, None, 1.0) == 0.0 and slot_wait_s(100, 4, None) == 0.0


def test_a_slow_engine_is_learned_from_a_few_measurements_spanning_prompt_lengths() -> None:
    """An engine 10× slower per token than the prior: after six measurements over a 10× range of
    prompt lengths, a prompt that needs 5 s alone is projected near 5 s (the prompt-alone row)."""
    m = PrefillModel()
    for x in (100, 200, 400, 600, 800, 1000):
        m.observe(x, 0.05 + 0.002 * x)
    alone = project(m, pending_tokens=0, prompt_tokens=2500).prompt_alone_s
    assert abs(alone - 5.05) < 0.5, alone
    refusal = judge(project(m, 0, 2500), 2.0)
    assert refusal is not None and refusal.error.code == "prompt_exceeds_ttft_budget"


def test_the_prior_is_configurable_per_engine() -> None:
    m = PrefillModel(prior_a=0.1, prior_b=0.003)
    assert (m.a, m.b) == (0.1, 0.003)
    assert judge(project(m, 0, 1000), 2.0) is not None  # 3.1 s before any measurement


def test_an_engine_config_states_its_prior() -> None:
    from narwhal_serve.config import EngineConfig
    from narwhal_serve.placement.engines import EngineState

    e = EngineState(EngineConfig(name="slow", url="http://x", ttft_prior_a_s=0.2, ttft_prior_b_s_per_token=0.004))
    assert (e.ttft_model.a, e.ttft_model.b) == (0.2, 0.004)
    assert EngineState(EngineConfig(name="d", url="http://y")).ttft_model.b == PRIOR_B


def test_a_per_request_cost_in_bursts_is_not_learned_as_a_per_token_cost() -> None:
    """Bursts of same-sized short prompts: each request queued ahead costs 25 ms whatever its
    tokens. The cost lands on requests ahead, and a long prompt on an idle engine stays cheap (the
    hostile-probe finding: without the term, b learned ~2.5 ms/token and 2,000 tokens looked like 5 s)."""
    rng = np.random.default_rng(0)
    m = PrefillModel()
    for _ in range(256):
        own, ahead = int(rng.integers(2, 13)), int(rng.integers(0, 20))
        m.observe(own + 10 * ahead, 0.01 + 0.025 * ahead + abs(float(rng.normal(0, 0.01))), ahead)
    assert abs(m.c - 0.025) < 0.005
    assert m.b < 2 * PRIOR_B
    assert m.predict(2000) < 0.5
    p = project(m, pending_tokens=100, prompt_tokens=10, pending_requests=10)
    assert abs(p.projected_s - (0.01 + 0.025 * 10)) < 0.1


def test_the_margins_quantile_is_numpys_to_the_bit() -> None:
    import random

    import numpy as np

    from narwhal_serve.prediction.ttft import quantile

    rng = random.Random(3)
    for n in (1, 2, 3, 7, 32, 255, 256):
        for _ in range(50):
            xs = [rng.lognormvariate(0, 1) - 1 for _ in range(n)]
            for q in (0.0, 0.5, 0.9, 0.95, 0.99, 1.0, rng.random()):
                assert quantile(sorted(xs), q) == float(np.quantile(np.array(xs), q))


def _system(samples: list[tuple[float, ...]], prior: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares system of the definition: rows [1, features] and the prior's rows appended."""
    from narwhal_serve.prediction.ttft import PRIOR_WEIGHT

    data = np.array(samples, dtype=float)
    n, k = len(data), len(prior)
    lam = PRIOR_WEIGHT / (1.0 + n / 8.0) / 2
    rows, ys = [np.column_stack([np.ones(n), data[:, :-1]])], [data[:, -1]]
    for i, (value, span) in enumerate(prior):
        row = np.zeros((1, k))
        row[0, i] = np.sqrt(lam) * span
        rows.append(row)
        ys.append(np.array([np.sqrt(lam) * span * value]))
    return np.vstack(rows), np.concatenate(ys)


def _lstsq_fit(samples: list[tuple[float, ...]], prior: tuple[tuple[float, float], ...]) -> np.ndarray:
    """The definition: least squares on [1, features] with the prior's rows appended."""
    m, y = _system(samples, prior)
    return np.linalg.lstsq(m, y, rcond=None)[0]


def test_the_fit_from_running_sums_is_the_least_squares_fit() -> None:
    """The models keep their window's sums as samples come and go (ttft.Gram) and solve the
    normal equations: the same coefficients as a least-squares solve over the window, through
    many slides of the window (rounding recounted), bunched, constant and huge features."""
    from collections import deque

    from narwhal_serve.prediction.ttft import PRIOR_REQUEST_SPAN, PRIOR_SLOPE_SPAN, WINDOW, Gram, fit_with_prior

    rng = np.random.default_rng(7)
    prior = ((0.02, 1.0), (0.0002, PRIOR_SLOPE_SPAN), (0.0, PRIOR_REQUEST_SPAN))
    cases = {
        "spread": lambda i: (float(rng.integers(10, 60_000)), float(rng.integers(0, 9))),
        "bunched": lambda i: (40_000.0 + float(rng.integers(0, 3)), 0.0),
        "constant": lambda i: (512.0, 1.0),
        "huge": lambda i: (float(rng.integers(10**6, 10**7)), float(rng.integers(0, 500))),
    }
    for name, draw in cases.items():
        window: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
        g = Gram(3)
        for i in range(3 * WINDOW + 17):
            x, r = draw(i)
            g.push(window, (x, r, 0.01 + 3e-5 * x + 0.002 * r + float(rng.normal(0, 0.01))))
            if i < 40 or i % 97 == 0 or i == 3 * WINDOW + 16:
                got, want = fit_with_prior(g, prior), _lstsq_fit(list(window), prior)
                for x_at in (0.0, 1_000.0, 50_000.0):  # the predictions agree, whatever the scale
                    p_got = got[0] + got[1] * x_at + got[2] * 2
                    p_want = want[0] + want[1] * x_at + want[2] * 2
                    assert abs(p_got - p_want) <= 1e-9 * max(1.0, abs(p_want)), (name, i, got, want)
    tpot: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
    g2 = Gram(2)
    for i in range(WINDOW + 5):
        b = float(rng.integers(1, 64))
        g2.push(tpot, (b, 0.02 + 0.001 * b))
        got2, want2 = fit_with_prior(g2, ((0.02, 1.0), (0.0, 8.0))), _lstsq_fit(list(tpot), ((0.02, 1.0), (0.0, 8.0)))
        assert np.allclose(got2, want2, rtol=1e-9, atol=1e-12), (i, got2, want2)


def test_the_prompt_alone_is_judged_with_the_margin_an_idle_engine_gets() -> None:
    """(Found by a hostile probe.) An engine whose margin had reached its cap doubled an idle
    projection: a prompt of 0.62 s against a 1 s budget was refused ``ttft_budget_exceeded`` with
    ``Retry-After: 1`` forever on an idle fleet (refused requests teach nothing). The prompt alone is
    judged with the margin: over the budget, no wait cures it, and the client is told so."""
    stuck = judge(Projection(0.62, 1.24, 1.24), 1.0)
    assert stuck is not None and stuck.error.code == "prompt_exceeds_ttft_budget" and stuck.error.retry_after is None
    assert "about 0.62 s (1.24 s with this engine's prediction margin) to first token" in stuck.error.message
    assert judge(Projection(0.62, 0.9, 0.9), 1.0) is None
    queued = judge(Projection(0.3, 1.5, 0.4), 1.0)  # (the margin alone fits: the queue is what waiting cures)
    assert queued is not None and queued.error.code == "ttft_budget_exceeded" and queued.error.retry_after == 1


def test_a_budget_narrowed_for_a_while_refuses_with_a_retry_after_not_for_good() -> None:
    """(Found by a hostile probe.) A tenant over its fair share is admitted within 75 % of its
    target while others are served; a prompt alone over that share, within its own target, was
    refused ``prompt_exceeds_ttft_budget`` (never retry) though the share ends when the others' load
    does. The prompt alone is judged on the request's own budget; the narrowed one refuses it with
    a Retry-After."""
    out = judge(Projection(0.85, 0.85, 0.85), 0.75, 1.0)
    assert out is not None and out.error.code == "ttft_budget_exceeded" and out.error.retry_after == 1
    assert judge(Projection(1.2, 1.2, 1.2), 0.75, 1.0).error.code == "prompt_exceeds_ttft_budget"  # type: ignore[union-attr]


def _bounded_best(samples: list[tuple[float, ...]], prior: tuple[tuple[float, float], ...],
                  floors: tuple[float, ...]) -> tuple[np.ndarray, float]:
    """The definition, by brute force: every set of coefficients held at their floors, the rest
    solved by least squares (rows as _lstsq_fit's); the best fit that keeps every floor."""
    import itertools

    m, y = _system(samples, prior)
    k = len(prior)
    best: tuple[np.ndarray, float] | None = None
    for held in itertools.chain.from_iterable(itertools.combinations(range(k), r) for r in range(k + 1)):
        coef = np.array(floors, dtype=float)
        free = [i for i in range(k) if i not in held]
        if free:
            rest = y - m[:, list(held)] @ coef[list(held)] if held else y
            coef[free] = np.linalg.lstsq(m[:, free], rest, rcond=None)[0]
        if all(coef[i] >= floors[i] - 1e-15 for i in range(k)):
            cost = float(np.sum((m @ coef - y) ** 2))
            if best is None or cost < best[1]:
                best = (coef, cost)
    assert best is not None
    return best


def test_a_coefficient_below_its_floor_is_held_there_and_the_others_fitted_without_it() -> None:
    """Raising a coefficient to its floor after the fact left the others as fitted beside its
    value below it. A TPOT that falls with the batch the requests were admitted at (admitted into
    an idle engine, then decoded in a full one) fitted a negative slope; raised to zero, the
    intercept stayed where that slope put it, above every measured TPOT. Now the fit within the
    floors is the best one (brute force over which coefficients sit at their floors), and a fit
    within its floors is the unconstrained one to the bit."""
    from collections import deque

    from narwhal_serve.prediction.decode import PRIOR_BATCH_SPAN, TpotModel
    from narwhal_serve.prediction.ttft import (PREFILL_FLOORS, PRIOR_REQUEST_SPAN, PRIOR_SLOPE_SPAN, WINDOW, Gram,
                                               fit_with_prior)

    rng = np.random.default_rng(11)
    tpot_prior = ((0.02, 1.0), (0.0, PRIOR_BATCH_SPAN))
    m = TpotModel()
    window: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
    g = Gram(2)
    for _ in range(200):  # measured 5.5-6 ms whatever the batch, falling slightly with it
        batch = float(rng.integers(1, 5))
        tpot = 0.0062 - 0.0002 * batch + float(rng.normal(0, 0.0001))
        m.observe(batch, tpot)
        g.push(window, (batch, tpot))
    free = fit_with_prior(g, tpot_prior)
    assert free[1] < 0  # the unconstrained slope is negative
    want, _ = _bounded_best(list(window), tpot_prior, (0.0, 0.0))
    assert m.b == 0.0 and abs(m.a - want[0]) < 1e-12
    assert max(t for _, t in window) > m.a > min(t for _, t in window)  # within what was measured
    assert free[0] > max(t for _, t in window)  # (the intercept the old clamp kept: above all of it)

    prefill_prior = ((0.02, 1.0), (0.0002, PRIOR_SLOPE_SPAN), (0.0, PRIOR_REQUEST_SPAN))
    for case in range(30):
        window = deque(maxlen=WINDOW)
        g = Gram(3)
        a, b, c = (float(v) for v in rng.uniform([-0.2, -1e-5, -0.05], [0.05, 1e-4, 0.05]))
        for _ in range(int(rng.integers(5, 300))):
            x, r = float(rng.integers(100, 20_000)), float(rng.integers(0, 4))
            g.push(window, (x, r, max(0.0, a + b * x + c * r + float(rng.normal(0, 0.01)))))
        got = fit_with_prior(g, prefill_prior, floors=PREFILL_FLOORS)
        want, best = _bounded_best(list(window), prefill_prior, PREFILL_FLOORS)
        assert all(got[i] >= PREFILL_FLOORS[i] for i in range(3)), (case, got)
        assert np.allclose(got, want, rtol=1e-7, atol=1e-12), (case, got, want)
        unbounded = fit_with_prior(g, prefill_prior)
        if all(unbounded[i] >= PREFILL_FLOORS[i] for i in range(3)):
            assert got == unbounded
