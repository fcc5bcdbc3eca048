"""The simulator's step-cost fit (pure: numpy only, no vLLM)."""
import random

import pytest

from qwen_vllm_ext.scheduling.sim import StepCostModel, fit_cost_model


def records(model: StepCostModel, n: int = 200, noise: float = 0.0, seed: int = 0,
            decode_column: bool = False) -> list[list[float]]:
    """Back-to-back steps whose durations follow ``model`` (rows: time, schedule_s, reqs, tokens, prefill, ctx
    and, with ``decode_column``, the decoding requests' context)."""
    rng = random.Random(seed)
    t, rows = 0.0, []
    for _ in range(n):
        reqs = rng.randint(1, 32)
        prefill = rng.choice([0, 0, rng.randint(16, 2000)])
        ctx = prefill * rng.randint(0, 3000)
        decode_ctx = sum(rng.randint(16, 3600) for _ in range(reqs - 1)) if decode_column else 0
        tokens = reqs + prefill
        rows.append([t, 0.0, reqs, tokens, prefill, ctx] + ([decode_ctx] if decode_column else []))
        t += model.cost(reqs, tokens, ctx, decode_ctx) * (1 + rng.uniform(-noise, noise))
    rows.append([t, 0.0, 1, 1, 0, 0] + ([0] if decode_column else []))
    return rows


def test_fit_recovers_the_cost_model():
    truth = StepCostModel(base=0.007, per_request=0.0002, per_token=0.00016, per_ctx=6.7e-8)
    model, stats = fit_cost_model(records(truth))
    assert stats["steps"] == 200 and stats["r2"] == pytest.approx(1.0) and not stats["decode_ctx_term"]
    for field in ("base", "per_request", "per_token", "per_ctx"):
        assert getattr(model, field) == pytest.approx(getattr(truth, field), rel=1e-6)
    noisy, stats = fit_cost_model(records(truth, noise=0.1, seed=1))
    assert 0.9 < stats["r2"] < 1.0 and noisy.per_token == pytest.approx(truth.per_token, rel=0.1)


def test_idle_gaps_are_not_steps_and_too_few_steps_refuse():
    truth = StepCostModel()
    rows = records(truth, n=50)
    gap = [[r[0] + 100.0] + r[1:] for r in records(truth, n=50, seed=2)]  # a second run, 100 s later
    model, stats = fit_cost_model(rows + gap)
    assert stats["steps"] == 50 + 50  # 101 consecutive pairs; the 100 s gap between the runs is dropped
    assert model.per_token == pytest.approx(truth.per_token, rel=1e-6)
    with pytest.raises(ValueError, match="at least 8"):
        fit_cost_model(records(truth, n=5))


def test_decode_context_term_is_fitted_when_the_records_have_it():
    truth = StepCostModel(base=0.007, per_request=0.0002, per_token=0.00016, per_ctx=6.7e-8, per_decode_ctx=4e-7)
    rows = records(truth, decode_column=True)
    model, stats = fit_cost_model(rows)
    assert stats["decode_ctx_term"] and model.per_decode_ctx == pytest.approx(4e-7, rel=1e-6)
    assert model.price(rows[0]) == pytest.approx(truth.price(rows[0]))
    # Mixed with older six-column records the term is left out (priced at 0), not guessed.
    older, stats = fit_cost_model(records(StepCostModel(), n=50) + [[r[0] + 1e4] + r[1:] for r in rows])
    assert not stats["decode_ctx_term"] and older.per_decode_ctx == 0.0
