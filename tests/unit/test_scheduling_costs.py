"""The step-cost fit the token-weighted scheduler runs online, and the request weights it prices from it."""
from __future__ import annotations

import random

import pytest

from qwen_vllm_ext.scheduling.costs import CostFit, StepCostModel, features


def steps(model: StepCostModel, n: int, seed: int = 0, noise: float = 0.0):
    rng = random.Random(seed)
    for _ in range(n):
        n_reqs = rng.randint(1, 32)
        prefill = rng.choice([0, 0, rng.randint(16, 2048)])
        tokens = n_reqs + prefill
        pre_ctx = prefill * (rng.randint(0, 2048) + prefill / 2)
        dec_ctx = n_reqs * rng.randint(64, 3000)
        x = features(n_reqs, tokens, pre_ctx, dec_ctx)
        yield x, model.cost(n_reqs, tokens, pre_ctx, dec_ctx) * (1 + rng.uniform(-noise, noise))


def close(a: StepCostModel, b: StepCostModel, rel: float) -> bool:
    return all(abs(getattr(a, f) - getattr(b, f)) <= rel * abs(getattr(b, f)) + 1e-12 for f in
               ("base", "per_request", "per_token", "per_ctx", "per_decode_ctx"))


def test_batch_fit_recovers_the_model_and_its_r2():
    truth = StepCostModel(base=0.0099, per_request=0.0001, per_token=6e-5, per_ctx=4.6e-9, per_decode_ctx=7.7e-8)
    fit = CostFit()
    fit.add_many(steps(truth, 400))
    model = fit.solve()
    assert close(model, truth, 1e-6)
    assert fit.r2(model) == pytest.approx(1.0, abs=1e-9)
    noisy = CostFit()
    noisy.add_many(steps(truth, 2000, seed=1, noise=0.1))
    assert close(noisy.solve(), truth, 0.15) and 0.9 < noisy.r2(noisy.solve()) < 1.0


def test_negative_coefficients_are_fixed_at_zero():
    truth = StepCostModel(base=0.005, per_request=0.0, per_token=1e-5, per_ctx=0.0, per_decode_ctx=0.0)
    fit = CostFit()
    fit.add_many(steps(truth, 300, noise=0.2))
    model = fit.solve()
    assert all(getattr(model, f) >= 0 for f in ("base", "per_request", "per_token", "per_ctx", "per_decode_ctx"))
    assert model.per_token == pytest.approx(1e-5, rel=0.2)


def test_too_few_or_degenerate_samples_give_no_model():
    fit = CostFit()
    fit.add_many(steps(StepCostModel(), 7))
    assert fit.solve() is None
    only_base = CostFit()
    for _ in range(20):
        only_base.add(features(0, 0, 0, 0), 0.01)
    model = only_base.solve()
    assert model is not None and model.base == pytest.approx(0.01) and model.per_token == 0.0
    with pytest.raises(ValueError):
        CostFit(forget=0.0)


def test_online_fit_with_forgetting_follows_a_changed_engine():
    slow = StepCostModel(base=0.02, per_request=0.001, per_token=2e-4)
    fast = StepCostModel(base=0.005, per_request=0.0002, per_token=5e-5)
    fit = CostFit(forget=0.99)
    fit.add_many(steps(slow, 500))
    assert close(fit.solve(), slow, 1e-3)
    fit.add_many(steps(fast, 1500, seed=2))
    assert close(fit.solve(), fast, 1e-3)
    never = CostFit()
    never.add_many(steps(slow, 500))
    never.add_many(steps(fast, 1500, seed=2))
    assert not close(never.solve(), fast, 0.05)  # without forgetting the old engine stays in the fit


def test_request_weight_follows_the_cost_shape():
    # Prefill-bound (an 8B model on a GPU-like shape): a long prompt weighs about its length, output tokens little.
    gpu = StepCostModel(base=0.0099, per_request=0.0, per_token=6e-5, per_ctx=4.6e-9, per_decode_ctx=7.7e-8)
    short, long = gpu.request_weight(200, 0, 40, 128), gpu.request_weight(2750, 0, 40, 128)
    assert long / short > 8
    # Slot-bound (the CPU demo model): each output token costs a large share of a step, prompts little.
    cpu = StepCostModel(base=0.0053, per_request=5.1e-4, per_token=7.3e-6, per_ctx=4.4e-9, per_decode_ctx=0.0)
    short, long = cpu.request_weight(200, 0, 40, 32), cpu.request_weight(2750, 0, 40, 32)
    assert 1.5 < long / short < 3
    assert cpu.output_weight(0, 32) > 50 and gpu.output_weight(0, 128) < 5
    # A cached prefix costs nothing to prefill but makes the uncached part's attention dearer.
    assert gpu.request_weight(100, 2000, 0, 1) < gpu.request_weight(2100, 0, 0, 1)
    assert gpu.request_weight(100, 2000, 0, 1) > gpu.request_weight(100, 0, 0, 1)
    # No per-token cost: the model cannot price a prompt token (the caller falls back to the token weight).
    assert StepCostModel(per_token=0.0).request_weight(100, 0, 10, 8) is None
