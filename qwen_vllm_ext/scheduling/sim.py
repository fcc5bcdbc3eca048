"""Offline scheduler simulation: a real vLLM V1 scheduler driven on a virtual clock with a fitted step-cost model.

No model runs. The scheduler is built the way upstream's ``tests/v1/core/utils.py`` builds one (local model
config, ``skip_tokenizer_init=True``, a synthetic KV-cache config), so admission, chunked prefill, the token
budget, ``max_num_seqs`` and preemption are vLLM's own code; only the *time* a step takes comes from a
:class:`StepCostModel` (seconds as a linear function of the step's composition, fitted from a real engine's
per-step records by :func:`fit_cost_model`). Each scheduled request that finishes its prompt samples one token
at the end of the step, which fixes its TTFT on the virtual clock.

It exists to explore policy settings in seconds instead of minutes (``benchmarks/sim_scheduler.py``); the
numbers that count come from the real engine (``benchmarks/bench_scheduler.py``).
"""
from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from .costs import CostFit, StepCostModel, features
from .policy import PolicyConfig

T0 = 1_000_000.0  # virtual epoch (arrival_time values are absolute seconds)


def fit_cost_model(records: Sequence[Sequence[float]], max_gap_s: float = 2.0) -> tuple[StepCostModel, dict]:
    """Least-squares fit of :class:`StepCostModel` (:class:`~.costs.CostFit`, the solver the scheduler uses online) to
    per-step records ``[time, schedule_s, n_reqs, tokens, prefill_tokens, prefill_ctx(, decode_ctx)]``
    (``bench_scheduler.py``'s ``comp`` rows; see :func:`~.engine_costs.step_composition`): a step's duration is the
    time to the next ``schedule()`` call, for back-to-back steps only (gaps over ``max_gap_s`` are idle time). The
    decode-context term is fitted only when every step used has that column (older results files do not). Returns
    the model and fit statistics (steps used, R^2, median relative error, whether the decode term was fitted)."""
    used, y = [], []
    for a, b in zip(records, records[1:]):
        dt = b[0] - a[0]
        if 0 < dt <= max_gap_s:
            used.append(a)
            y.append(dt)
    if len(used) < 8:
        raise ValueError(f"need at least 8 back-to-back steps to fit, got {len(used)}")
    with_decode = all(len(a) > 6 for a in used)
    fit = CostFit()
    fit.add_many((features(a[2], a[3], a[5], a[6] if with_decode else 0.0), dt) for a, dt in zip(used, y))
    model = fit.solve()
    if model is None:
        raise ValueError("the step records do not determine a cost model (singular)")
    errors = sorted(abs(model.price(a) - dt) / dt for a, dt in zip(used, y))
    return model, {"steps": len(y), "r2": fit.r2(model), "median_rel_err": errors[len(errors) // 2],
                   "decode_ctx_term": with_decode}


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build_config(model_dir: str, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 4096, num_blocks: int = 32768, block_size: int = 16,
                 enable_prefix_caching: bool = True, async_scheduling: bool = False,
                 scheduling_policy: str = "fcfs") -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` for a scheduler with no model behind it (``model_dir`` only supplies the
    model config; ``async_scheduling`` is set after construction, as the CPU platform forces it off;
    ``scheduling_policy``: vLLM's ``--scheduling-policy``, fcfs or priority)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, policy=scheduling_policy)
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    return vllm_config, kv_cache_config


def build_scheduler(model_dir: str, cls: Any = None, *, policy: PolicyConfig | None = None, clock: Any = None,
                    log_stats: bool = False, auto: bool = False, **config: Any) -> Any:
    """A real vLLM V1 scheduler with no model behind it: ``cls`` (default: vLLM's FCFS ``Scheduler``; the
    token-weighted classes get ``policy``, ``clock`` and ``auto`` — behind the overload gate — through
    ``qwen_configure``); ``config``: see :func:`build_config`."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config, kv_cache_config = build_config(model_dir, **config)
    cls = cls or Scheduler
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                    block_size=vllm_config.cache_config.block_size,
                    structured_output_manager=StructuredOutputManager(vllm_config), log_stats=log_stats)
    if hasattr(scheduler, "qwen_configure"):
        scheduler.qwen_configure(policy=policy or PolicyConfig(), clock=clock, auto=auto)
    return scheduler


def simulate(model_dir: str, requests: Sequence[dict], arrivals: Sequence[float], cost: StepCostModel, *,
             token_weighted: bool, policy: PolicyConfig | None = None, warm: dict | None = None,
             auto: bool = False, **engine: Any) -> dict:
    """Replay one trace (``requests``: dicts with ``i``, ``prompt_len``, ``max_tokens``, ``long``; ``arrivals``:
    seconds from the trace start) through a real scheduler on a virtual clock. Returns the same shape as
    ``bench_scheduler``'s replay (what :mod:`qwen_vllm_ext.bench.scheduler_traces` summarizes): ``requests`` (arrival,
    ttft, e2e, done, out_tokens, ...), ``t_first_arrival``, ``t_end``, plus ``steps`` (``[time, n_admitted, 0.0]``),
    ``warm`` (the step-cost fit of this run's steps and its mean requests per step) and the virtual time spent. ``warm`` (another run's) starts the token-weighted scheduler's
    online cost fit from that run's, as on an engine that has been serving the same traffic (a fresh one weighs by
    tokens for its first ``COST_MIN_STEPS`` steps). ``auto``: the token-weighted scheduler behind its overload gate
    (``token_weighted_scheduler=auto``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    os.environ.setdefault("QWEN_VLLM_EXT_INSTANCE_DIR", tempfile.mkdtemp(prefix="qwen-sim-"))
    clock = _Clock(T0)
    from .engine_costs import step_composition
    from .vllm_scheduler import TokenWeightedScheduler

    scheduler = build_scheduler(model_dir, TokenWeightedScheduler if token_weighted else None, policy=policy,
                                clock=clock, auto=auto, **engine)
    if token_weighted and warm is not None:
        scheduler.qwen_warm_costs(warm["fit"], warm["batch"])
    fit, batch_sum, busy_steps = CostFit(), 0, 0
    hasher = get_request_block_hasher(scheduler.cache_config.block_size, sha256)
    ids = itertools.count()
    order = sorted(range(len(requests)), key=lambda k: arrivals[k])
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    out_tokens: dict[str, int] = {}
    steps: list[list[float]] = []
    overloaded_steps = 0
    seen: set[str] = set()
    nxt = 0
    while nxt < len(order) or scheduler.has_unfinished_requests():
        while nxt < len(order) and T0 + arrivals[order[nxt]] <= clock.t:
            k = order[nxt]
            r = requests[k]
            base = 1000 + next(ids) * 8192
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
            scheduler.add_request(Request(request_id=str(k), prompt_token_ids=list(range(base, base + r["prompt_len"])),
                                          sampling_params=params, pooling_params=None,
                                          arrival_time=T0 + arrivals[k], block_hasher=hasher))
            nxt += 1
        if not scheduler.has_unfinished_requests():
            clock.t = T0 + arrivals[order[nxt]]
            continue
        output = scheduler.schedule()
        overloaded_steps += bool(auto and token_weighted and not scheduler.waiting.exact)
        n_reqs, tokens, _, pre_ctx, dec_ctx = step_composition(scheduler.requests, output)
        admitted = [rid for rid in output.num_scheduled_tokens if rid not in seen]
        seen.update(admitted)
        if admitted:
            steps.append([clock.t, len(admitted), 0.0])
        dt = cost.cost(n_reqs, tokens, pre_ctx, dec_ctx)
        clock.t += dt
        fit.add(features(n_reqs, tokens, pre_ctx, dec_ctx), dt)
        batch_sum += n_reqs
        busy_steps += 1
        req_ids = list(output.num_scheduled_tokens)
        samplers = {rid for rid in req_ids
                    if rid in scheduler.requests and not scheduler.requests[rid].is_prefill_chunk}
        for rid in samplers:
            first.setdefault(rid, clock.t)
            out_tokens[rid] = out_tokens.get(rid, 0) + 1
        runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[7] if r in samplers else [] for r in req_ids])
        for outs in scheduler.update_from_output(output, runner).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    done[o.request_id] = clock.t
    results = []
    for k, r in enumerate(requests):
        arrival = T0 + arrivals[k]
        rid = str(k)
        results.append({"i": r["i"], "prompt_len": r["prompt_len"], "max_tokens": r["max_tokens"],
                        "long": r.get("long", False), "arrival": arrival, "sent_lag": 0.0,
                        "ttft": first[rid] - arrival, "e2e": done[rid] - arrival, "done": done[rid],
                        "out_tokens": out_tokens.get(rid, 0)})
    return {"t0": T0, "t_first_arrival": T0 + min(arrivals), "t_end": max(x["done"] for x in results),
            "requests": results, "steps": steps, "warm": {"fit": fit, "batch": batch_sum / max(busy_steps, 1)},
            "qwen_stats": scheduler.qwen_stats.snapshot() if token_weighted else None,
            "gate": {"overloaded_steps": overloaded_steps, "steps": busy_steps,
                     "switches": scheduler.waiting.gate.switches} if auto and token_weighted else None}
