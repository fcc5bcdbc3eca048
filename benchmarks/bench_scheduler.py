#!/usr/bin/env python
"""Token-weighted admission scheduler vs vLLM's FCFS on the real vLLM CPU engine, in one run.

Traces (seeded, the same for both policies at a load level; open-loop Poisson arrivals):

* ``longtail`` — 90% short prompts (32–384 tokens, log-uniform), 10% long prompts (2,000–3,500 tokens),
  16–64 output tokens each (``ignore_eos``: every request decodes exactly that many);
* ``burst`` — the same kind of mix with 5% long prompts, arrivals alternating a low rate and a burst window
  (4x the low rate during the last quarter of every period, the period being a third of the trace's expected
  duration: the "high-rate window every minute" of a service, scaled down to fit the run, ~3 bursts per
  trace); the mean rate is the requested one.

Prompts are random token ids (distinct per request: no prefix-cache hits, so the comparison is about
ordering, not caching).

Model (``--model``): a generated random-weight Qwen3 (``qwen_vllm_ext.demo.VARIANTS``). The default,
``prefill-bench``, has the cost shape admission ordering is about — a long prefill costs tens of full-batch
decode steps, as for a real model on a GPU. The tiny ``demo`` model is decode-slot-bound instead (a 2,000-token
prefill costs about one decode step): there every request holds a batch slot for its whole output whatever its
prompt length, so ordering by prompt tokens cannot shorten the queue. The capacity phase measures and prints
the cost shape (a 2,000-token prefill alone vs one decode step of a full batch).

Phases, each engine in a fresh subprocess (``--worker``) so the engine core sees its own ``QWEN_VLLM_EXT_SCHED_*``
settings:

1. **capacity** — FCFS engine, each trace's request mix submitted all at once (saturation): sustained
   requests/s = requests / (last completion - first submission).
2. **replay** — for each load level (default 1.2x and 1.7x of the measured capacity), each trace and each policy
   (FCFS = vLLM's default ``Scheduler``; token-weighted = ``TokenWeightedScheduler``), a fresh engine replays the
   trace by its timestamps (an asyncio task per request sleeps until its arrival, then calls
   ``AsyncLLM.generate``). Both policies replay a trace back to back, the one going first alternating by trace,
   load level and repeat, so a drift in the machine's speed (several percent over minutes on this 2-core
   machine) hits both alike; ``--repeats`` repeats the whole replay phase.

TTFT = first streamed output - scheduled arrival time (a client falling behind its schedule counts against
the engine, as a real client's wait would). Per run: TTFT mean / p50 / p99, p99 TTFT of the longest decile of
requests by prompt length, output tokens/s (output tokens / (last completion - first arrival)), goodput under
a TTFT SLO (requests with TTFT <= ``--slo`` seconds per second of the same span, and their share), and the
mean per-step standard deviation of the weights (uncached prompt tokens + 0.7 x min(max_tokens, cap)) of the
requests a step admits (steps admitting two or more). The admitted weights are recorded in the engine core by a
thin subclass of each scheduler (``BenchFCFSScheduler`` / ``BenchTokenWeightedScheduler`` in this module, which
only observe ``schedule()``'s output), so the figure is computed the same way for both; the token-weighted
scheduler's own ``qwen_stats`` figure is reported too. The same subclasses time ``schedule()`` (the "sched ms"
column) and record every step's composition (requests, tokens, prefill tokens, prefill and decode context) and
where its time went (``schedule()``, the model step, ``update_from_output()``) under ``per_step`` in the JSON:
``sim_scheduler.py --fit`` fits its step-cost model to those records.

Targets at every load level (per trace and over all traces' requests pooled): mean TTFT <= 0.5x FCFS,
longest-decile p99 TTFT <= 1.2x FCFS, output throughput >= 1.0x FCFS. The pooled rows decide the exit status.

    .venv/bin/python benchmarks/bench_scheduler.py            # ~10-13 minutes on 2 cores
    .venv/bin/python benchmarks/bench_scheduler.py --quick    # smoke run, ~4 minutes
    .venv/bin/python benchmarks/bench_scheduler.py --loads 1.2,1.7 --repeats 2 --sched QWEN_VLLM_EXT_SCHED_MAX_WAIT_S=20

Writes ``benchmarks/results/bench_scheduler.json`` (``bench_scheduler_quick.json`` with ``--quick``), a PNG of
the TTFT CDFs next to it, and the workers' logs under ``benchmarks/results/bench_scheduler_logs/``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODULE = "bench_scheduler"  # importable in the engine core: HERE is put on PYTHONPATH
POLICIES = ("fcfs", "tw")
POLICY_NAMES = {"fcfs": "FCFS", "tw": "token-weighted"}
OUTPUT_WEIGHT = 0.7
OUTPUT_CAP = 1024

ENGINE_KW = dict(enforce_eager=True, dtype="float32", max_num_seqs=32, max_num_batched_tokens=2048,
                 max_model_len=4096, seed=0)

TRACE_SPECS = {
    "longtail": {"long_frac": 0.10, "burst": None},
    # period_s: None = a third of the trace's expected duration (n / rate), so every run sees ~3 bursts.
    "burst": {"long_frac": 0.05, "burst": {"period_s": None, "window_frac": 0.25, "factor": 4.0}},
}
SHORT_RANGE = (32, 384)
LONG_RANGE = (2000, 3500)
OUT_RANGE = (16, 64)


# ---------------------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------------------
def make_mix(kind: str, n: int, seed: int) -> list[dict]:
    """Request sizes of a trace (the same for every rate): prompt_len, max_tokens, token seed."""
    spec = TRACE_SPECS[kind]
    rng = random.Random(f"{kind}-{seed}-mix")
    n_long = max(1, round(n * spec["long_frac"]))
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    mix = []
    for i, long_ in enumerate(is_long):
        if long_:
            plen = rng.randint(*LONG_RANGE)
        else:
            lo, hi = SHORT_RANGE
            plen = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        mix.append({"i": i, "prompt_len": plen, "max_tokens": rng.randint(*OUT_RANGE), "long": long_,
                    "token_seed": rng.randrange(1 << 30)})
    return mix


def make_arrivals(kind: str, n: int, rate: float, seed: int) -> list[float]:
    """Open-loop Poisson arrival times (s from the trace start) at mean ``rate`` req/s (piecewise-constant rate
    for ``burst``; exact: the exponential is memoryless, so a draw crossing a rate change restarts there)."""
    spec = TRACE_SPECS[kind]
    rng = random.Random(f"{kind}-{seed}-arrivals")
    burst = spec["burst"]
    if burst is None:
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    period = burst["period_s"] or n / rate / 3.0
    window, factor = burst["window_frac"] * period, burst["factor"]
    base = rate * period / (period - window + factor * window)
    # Burst window at the END of each period: the trace starts with a quiet stretch. Segments are walked by
    # index (no float round-off can leave a draw stuck on a boundary).
    seg, t, out = 0, 0.0, []
    while len(out) < n:
        k, burst_seg = divmod(seg, 2)
        lam = base * factor if burst_seg else base
        boundary = k * period + (period if burst_seg else period - window)
        t = max(t, k * period + (period - window if burst_seg else 0.0))
        dt = rng.expovariate(lam)
        if t + dt >= boundary:
            seg += 1
            continue
        t += dt
        out.append(t)
    return out


def prompt_ids(req: dict, vocab_size: int = 151936) -> list[int]:
    rng = random.Random(req["token_seed"])
    return [rng.randrange(1000, min(vocab_size - 100, 150000)) for _ in range(req["prompt_len"])]


# ---------------------------------------------------------------------------------------------------------
# Engine-core side: scheduler subclasses that record the weights each step admits
# ---------------------------------------------------------------------------------------------------------
def _make_recording(base):
    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._bench_seen: set[str] = set()
            self._bench_steps: list[list[float]] = []  # [time, n_admitted, std]
            # [time, schedule_s, n_reqs, tokens, prefill_tokens, prefill_ctx, decode_ctx, execute_s, update_s]:
            # time is taken when schedule() returns; execute_s runs from there to update_from_output() (the model
            # step), update_s is update_from_output() itself (filled in when it runs).
            self._bench_comp: list[list[float]] = []
            self._bench_path = os.environ.get("BENCH_SCHED_STATS", "")
            self._bench_dirty = False

        def schedule(self, *args, **kwargs):
            t_sched = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            dt_sched = time.perf_counter() - t_sched
            # Step composition, the cost-model data of sim_scheduler.py: requests, tokens, prefill tokens, prefill
            # and decode context (qwen_vllm_ext.scheduling.vllm_scheduler.step_composition).
            from qwen_vllm_ext.scheduling.vllm_scheduler import step_composition

            self._bench_comp.append([time.time(), dt_sched, *step_composition(self.requests, out)])
            weights = []
            for rid, n_sched in out.num_scheduled_tokens.items():
                if rid in self._bench_seen:
                    continue
                self._bench_seen.add(rid)
                req = self.requests.get(rid)
                if req is None:
                    continue
                cached = max(req.num_computed_tokens - n_sched, 0)
                expected = min(req.max_tokens or OUTPUT_CAP, OUTPUT_CAP)
                weights.append(max(req.num_prompt_tokens - cached, 0) + OUTPUT_WEIGHT * expected)
            if weights:
                n = len(weights)
                mean = sum(weights) / n
                std = math.sqrt(sum((w - mean) ** 2 for w in weights) / n) if n >= 2 else 0.0
                self._bench_steps.append([time.time(), n, std])
                self._bench_dirty = True
            return out

        def update_from_output(self, *args, **kwargs):
            t_update = time.time()
            result = super().update_from_output(*args, **kwargs)
            if self._bench_comp and len(self._bench_comp[-1]) == 7:
                row = self._bench_comp[-1]
                row += [t_update - row[0], time.time() - t_update]
            if self._bench_dirty and self._bench_path and not self.has_unfinished_requests():
                self._bench_dump()
            return result

        def _bench_dump(self):
            data = {"steps": self._bench_steps, "comp": self._bench_comp, "class": type(self).__mro__[1].__name__}
            stats = getattr(self, "qwen_stats", None)
            if stats is not None:
                data["qwen_stats"] = stats.snapshot()
                data["qwen_policy"] = {k: v for k, v in vars(self.qwen_policy).items()}
            tmp = self._bench_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self._bench_path)
            self._bench_dirty = False

    Recording.__name__ = Recording.__qualname__ = "Bench" + base.__name__
    return Recording


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):  # PEP 562: vLLM resolves "bench_scheduler.BenchFCFSScheduler" lazily
    if name in ("BenchFCFSScheduler", "BenchTokenWeightedScheduler"):
        if name not in _CLASSES:
            if name == "BenchFCFSScheduler":
                from vllm.v1.core.sched.scheduler import Scheduler

                cls = _make_recording(Scheduler)
                cls.__name__ = cls.__qualname__ = name
            else:
                from qwen_vllm_ext.scheduling.vllm_scheduler import TokenWeightedScheduler

                cls = _make_recording(TokenWeightedScheduler)
                cls.__name__ = cls.__qualname__ = name
            cls.__module__ = MODULE
            _CLASSES[name] = cls
        return _CLASSES[name]
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------------------
# Worker: one engine, several traces replayed by timestamp
# ---------------------------------------------------------------------------------------------------------
async def _replay(engine, reqs: list[dict], arrivals: list[float], tag: str, vocab_size: int) -> dict:
    import asyncio

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts = [prompt_ids(r, vocab_size) for r in reqs]
    results: list[dict] = [None] * len(reqs)  # type: ignore[list-item]
    t0 = time.time() + 0.5

    async def one(k: int) -> None:
        r = reqs[k]
        arrival = t0 + arrivals[k]
        delay = arrival - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.time()
        sp = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)
        first = None
        n_out = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompts[k]), sp, f"{tag}-{k}"):
            if first is None:
                first = time.time()
            n_out += len(out.outputs[0].token_ids)
        done = time.time()
        results[k] = {"i": r["i"], "prompt_len": r["prompt_len"], "max_tokens": r["max_tokens"], "long": r["long"],
                      "arrival": arrival, "sent_lag": sent - arrival, "ttft": first - arrival,
                      "e2e": done - arrival, "done": done, "out_tokens": n_out}

    await asyncio.gather(*(one(k) for k in range(len(reqs))))
    return {"t0": t0, "t_first_arrival": t0 + min(arrivals), "t_end": max(x["done"] for x in results),
            "requests": results}


async def _probe(engine, vocab_size: int) -> dict:
    """The model's cost shape on this machine: one 2,000-token prefill alone vs one decode step of a full batch
    (``max_num_seqs`` requests of 16-token prompts decoding 33 tokens; the step time is taken from the
    difference with a 1-token run, so prefill and start-up cancel out). Best of three each."""
    n = ENGINE_KW["max_num_seqs"]

    async def timed(reqs: list[dict], tag: str) -> float:
        t = time.time()
        await _replay(engine, reqs, [0.0] * len(reqs), tag, vocab_size)
        return time.time() - t

    def batch(out: int) -> list[dict]:
        return [{"i": i, "prompt_len": 16, "max_tokens": out, "long": False, "token_seed": 100 + i} for i in range(n)]

    prefill, decode = [], []
    for k in range(3):
        prefill.append(await timed([{"i": 0, "prompt_len": 2000, "max_tokens": 1, "long": True,
                                     "token_seed": 7 + k}], f"probe-p{k}"))
        one = await timed(batch(1), f"probe-d1-{k}")
        full = await timed(batch(33), f"probe-d33-{k}")
        decode.append(max(full - one, 1e-6) / 32)
    p, d = min(prefill), min(decode)
    return {"prefill_2000_s": p, "decode_step_s": d, "prefill_over_decode_step": p / d}


def worker(spec_path: str, out_path: str) -> None:
    import asyncio

    with open(spec_path) as f:
        spec = json.load(f)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from qwen_vllm_ext.demo import CONFIG, VARIANTS, ensure_demo_model

    vocab = {**CONFIG, **VARIANTS[spec["model"]]}["vocab_size"]
    cls = "BenchTokenWeightedScheduler" if spec["policy"] == "tw" else "BenchFCFSScheduler"
    t_start = time.time()
    args = AsyncEngineArgs(model=str(ensure_demo_model(variant=spec["model"])), scheduler_cls=f"{MODULE}.{cls}",
                           disable_log_stats=True, **ENGINE_KW)
    engine = AsyncLLM.from_engine_args(args)
    t_ready = time.time()
    stats_path = os.environ["BENCH_SCHED_STATS"]

    async def main() -> dict:
        # Warm-up: one long and a few short requests (not measured).
        warm = [{"i": -1, "prompt_len": 3000, "max_tokens": 8, "long": True, "token_seed": 1},
                {"i": -2, "prompt_len": 100, "max_tokens": 8, "long": False, "token_seed": 2},
                {"i": -3, "prompt_len": 60, "max_tokens": 8, "long": False, "token_seed": 3}]
        await _replay(engine, warm, [0.0, 0.05, 0.1], "warm", vocab)
        probe = await _probe(engine, vocab) if spec.get("probe") else None
        runs = []
        for job in spec["jobs"]:
            await asyncio.sleep(0.5)
            r = await _replay(engine, job["requests"], job["arrivals"], job["name"], vocab)
            # The engine core dumps its per-step records once it has no unfinished request.
            deadline = time.time() + 5.0
            steps_data = {}
            while time.time() < deadline:
                try:
                    with open(stats_path) as f:
                        steps_data = json.load(f)
                    if steps_data["steps"] and steps_data["steps"][-1][0] >= r["t_first_arrival"]:
                        break
                except (OSError, ValueError, KeyError):
                    pass
                await asyncio.sleep(0.1)
            steps = [s for s in steps_data.get("steps", []) if r["t0"] <= s[0] <= r["t_end"] + 0.5]
            r["steps"] = steps
            r["comp"] = [c for c in steps_data.get("comp", []) if r["t0"] <= c[0] <= r["t_end"] + 0.5]
            r["qwen_stats"] = steps_data.get("qwen_stats")
            r["qwen_policy"] = steps_data.get("qwen_policy")
            r["name"] = job["name"]
            runs.append(r)
        return {"runs": runs, "probe": probe}

    try:
        result = asyncio.run(main())
    finally:
        engine.shutdown()
    result.update({"policy": spec["policy"], "startup_s": t_ready - t_start})
    with open(out_path, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------------------
# Parent: orchestration, metrics, report
# ---------------------------------------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    rank = max(1, math.ceil(q * len(s)))
    return float(s[min(rank, len(s)) - 1])


def run_worker(policy: str, jobs: list[dict], sched_env: dict[str, str], log_name: str, model: str,
               probe: bool = False) -> dict:
    """One worker process: a fresh engine with ``policy``'s scheduler replaying ``jobs`` in order."""
    os.makedirs(os.path.join(RESULTS, "bench_scheduler_logs"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-sched-")
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
    with open(spec_path, "w") as f:
        json.dump({"policy": policy, "jobs": jobs, "model": model, "probe": probe}, f)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["PYTHONPATH"] = HERE + os.pathsep + ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["BENCH_SCHED_STATS"] = os.path.join(tmp, "steps.json")
    env["QWEN_VLLM_EXT_INSTANCE_DIR"] = os.path.join(tmp, "instance")
    env["QWEN_VLLM_EXT_TOKEN_WEIGHTED_SCHEDULER"] = "0"  # the policy comes from scheduler_cls only
    env.pop("QWEN_VLLM_EXT_SETTINGS", None)  # resolve sched_* from the environment below
    for k in list(env):
        if k.startswith("QWEN_VLLM_EXT_SCHED_"):
            del env[k]
    env.update(sched_env)
    log_path = os.path.join(RESULTS, "bench_scheduler_logs", f"{log_name}.log")
    t = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", spec_path, out_path],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"worker {log_name} failed (rc={proc.returncode}); log {log_path}:\n{tail}")
    with open(out_path) as f:
        out = json.load(f)
    out["wall_s"] = time.time() - t
    print(f"  [{log_name}] {out['wall_s']:.0f}s (engine start {out['startup_s']:.0f}s)", flush=True)
    return out


def summarize(run: dict, slo: float) -> dict:
    reqs = run["requests"]
    ttft = [r["ttft"] for r in reqs]
    span = run["t_end"] - run["t_first_arrival"]
    out_tokens = sum(r["out_tokens"] for r in reqs)
    by_len = sorted(reqs, key=lambda r: (r["prompt_len"], r["i"]))
    decile = by_len[len(by_len) - max(1, len(by_len) // 10):]
    good = [r for r in reqs if r["ttft"] <= slo]
    steps = run.get("steps") or []
    multi = [s[2] for s in steps if s[1] >= 2]
    qs = run.get("qwen_stats") or {}
    comp = run.get("comp") or []
    return {
        "requests": len(reqs),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "long_decile_p99_ttft_s": quantile([r["ttft"] for r in decile], 0.99),
        "long_decile_min_prompt": decile[0]["prompt_len"],
        "output_tok_s": out_tokens / span,
        "span_s": span,
        "goodput_req_s": len(good) / span,
        "slo_attainment": len(good) / len(reqs),
        "admitted_weight_std_mean": (sum(multi) / len(multi)) if multi else 0.0,
        "admit_steps": len(steps),
        "mean_admitted_per_step": (sum(s[1] for s in steps) / len(steps)) if steps else 0.0,
        "qwen_stats_weight_std_mean": qs.get("admitted_weight_std_mean"),
        "max_wait_admissions": qs.get("max_wait_admissions"),
        "client_lag_p99_s": quantile([r["sent_lag"] for r in reqs], 0.99),
        "schedule_ms_per_step": (1000 * sum(c[1] for c in comp) / len(comp)) if comp else None,
        "engine_steps": len(comp),
    }


def pooled(runs: list[dict]) -> dict:
    """Pool several traces' runs: requests concatenated; throughput = total tokens / total span."""
    reqs, span, steps, comp = [], 0.0, [], []
    for r in runs:
        reqs += r["requests"]
        span += r["t_end"] - r["t_first_arrival"]
        steps += r.get("steps") or []
        comp += r.get("comp") or []
    return {"requests": reqs, "t_first_arrival": 0.0, "t_end": span, "steps": steps, "comp": comp}


def fmt(x, nd=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="short smoke run (fewer requests, one load level)")
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default 300, quick 80)")
    ap.add_argument("--cap-requests", type=int, default=None, help="requests per capacity run (default 120)")
    ap.add_argument("--loads", default=None, help="load levels, x capacity (default 1.2,1.7; quick 1.7)")
    ap.add_argument("--traces", default="longtail,burst")
    ap.add_argument("--repeats", type=int, default=1, help="repeat the replay phase (results averaged)")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds (default 2.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", default=None,
                    help="skip the capacity phase: req/s per trace, e.g. longtail=5.1,burst=6.0")
    ap.add_argument("--sched", action="append", default=[],
                    help="QWEN_VLLM_EXT_SCHED_*=VALUE for the token-weighted engine (repeatable)")
    ap.add_argument("--model", default="prefill-bench", choices=("prefill-bench", "demo"),
                    help="generated model variant (qwen_vllm_ext.demo.VARIANTS): prefill-bench (default; a long "
                         "prefill costs ~25-30 full decode steps, as for a mid-size model on a GPU) or demo (the "
                         "tiny demo model: a 2,000-token prefill costs less than one decode step)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0

    t_run = time.time()
    n = args.requests or (80 if args.quick else 300)
    n_cap = args.cap_requests or (60 if args.quick else 120)
    loads = [float(x) for x in (args.loads or ("1.7" if args.quick else "1.2,1.7")).split(",")]
    traces = [t for t in args.traces.split(",") if t]
    sched_env = dict(kv.split("=", 1) for kv in args.sched)
    out_path = args.out or os.path.join(RESULTS, "bench_scheduler_quick.json" if args.quick else "bench_scheduler.json")
    os.makedirs(RESULTS, exist_ok=True)
    print(f"bench_scheduler: {n} requests/trace, traces {traces}, loads {loads}, repeats {args.repeats}, "
          f"SLO {args.slo}s, token-weighted settings {sched_env or 'defaults'}", flush=True)

    # 1. Capacity (FCFS, all requests at t=0).
    probe = None
    if args.capacity:
        capacity = {k: {"req_s": float(v)} for k, v in (kv.split("=") for kv in args.capacity.split(","))}
    else:
        print("capacity phase (FCFS, saturation)...", flush=True)
        jobs = []
        for kind in traces:
            mix = make_mix(kind, n_cap, args.seed + 1000)
            jobs.append({"name": f"cap-{kind}", "requests": mix, "arrivals": [0.0] * len(mix)})
        cap_out = run_worker("fcfs", jobs, {}, "capacity", args.model, probe=True)
        probe = cap_out["probe"]
        print(f"  cost shape: a 2,000-token prefill alone {probe['prefill_2000_s'] * 1000:.0f} ms, a decode step of "
              f"{ENGINE_KW['max_num_seqs']} requests {probe['decode_step_s'] * 1000:.1f} ms "
              f"(ratio {probe['prefill_over_decode_step']:.1f})", flush=True)
        capacity = {}
        for kind, run in zip(traces, cap_out["runs"]):
            span = run["t_end"] - run["t0"]
            reqs = run["requests"]
            capacity[kind] = {"req_s": len(reqs) / span, "output_tok_s": sum(r["out_tokens"] for r in reqs) / span,
                              "prompt_tok_s": sum(r["prompt_len"] for r in reqs) / span, "span_s": span}
            print(f"  capacity {kind}: {capacity[kind]['req_s']:.2f} req/s, "
                  f"{capacity[kind]['output_tok_s']:.0f} output tok/s", flush=True)

    # 2. Replays: a fresh engine per trace and policy; each trace is replayed by both policies back to back (which
    # goes first alternates by trace, load and repeat), so a drift in the machine's speed hits both alike.
    raw: dict = {}  # (load, policy) -> list over repeats of {trace: run}
    for rep in range(args.repeats):
        for li, load in enumerate(loads):
            for ti, kind in enumerate(traces):
                rate = load * capacity[kind]["req_s"]
                job = {"name": f"{kind}-x{load}", "requests": make_mix(kind, n, args.seed),
                       "arrivals": make_arrivals(kind, n, rate, args.seed)}
                for policy in (POLICIES if (ti + li + rep) % 2 == 0 else POLICIES[::-1]):
                    print(f"replay {kind} at {load}x, {POLICY_NAMES[policy]} (repeat {rep + 1})...", flush=True)
                    out = run_worker(policy, [job], sched_env if policy == "tw" else {},
                                     f"replay-{kind}-x{load}-{policy}-r{rep + 1}", args.model)
                    raw.setdefault((load, policy), [{} for _ in range(args.repeats)])[rep][kind] = out["runs"][0]

    # 3. Metrics.
    summary: dict = {}
    for (load, policy), reps in raw.items():
        for scope in traces + ["all"]:
            per_rep = []
            for runs in reps:
                run = pooled([runs[t] for t in traces]) if scope == "all" else runs[scope]
                s = summarize(run, args.slo)
                if scope == "all":
                    qs = [runs[t].get("qwen_stats") for t in traces]
                    s["qwen_stats_weight_std_mean"] = qs[-1]["admitted_weight_std_mean"] if qs[-1] else None
                per_rep.append(s)
            agg = {}
            for k in per_rep[0]:
                vals = [p[k] for p in per_rep if p[k] is not None]
                agg[k] = (sum(vals) / len(vals)) if vals else None
                if len(per_rep) > 1 and vals:
                    agg[k + "_spread"] = [min(vals), max(vals)]
            agg["repeats"] = per_rep
            summary.setdefault(str(load), {}).setdefault(scope, {})[policy] = agg

    targets = [("ttft_mean_s", "mean TTFT", "<=", 0.5), ("long_decile_p99_ttft_s", "long-decile p99 TTFT", "<=", 1.2),
               ("output_tok_s", "output tok/s", ">=", 1.0)]
    verdicts: dict = {}
    lines = []
    hdr = (f"{'load':>5} {'trace':>8} {'policy':>6} {'TTFT mean':>9} {'p50':>6} {'p99':>6} {'long p99':>8} "
           f"{'out tok/s':>9} {'goodput':>7} {'SLO%':>5} {'wstd':>6} {'adm/step':>8} {'sched ms':>8}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for load in loads:
        for scope in traces + ["all"]:
            rows = summary[str(load)][scope]
            for policy in POLICIES:
                s = rows[policy]
                lines.append(f"{load:>5} {scope:>8} {('FCFS' if policy == 'fcfs' else 'TW'):>6} "
                             f"{fmt(s['ttft_mean_s']):>9} {fmt(s['ttft_p50_s']):>6} {fmt(s['ttft_p99_s']):>6} "
                             f"{fmt(s['long_decile_p99_ttft_s']):>8} {fmt(s['output_tok_s'], 1):>9} "
                             f"{fmt(s['goodput_req_s']):>7} {fmt(100 * s['slo_attainment'], 0):>5} "
                             f"{fmt(s['admitted_weight_std_mean'], 0):>6} {fmt(s['mean_admitted_per_step'], 1):>8} "
                             f"{fmt(s['schedule_ms_per_step'], 2):>8}")
            f, t = rows["fcfs"], rows["tw"]
            parts = []
            for key, label, op, lim in targets:
                ratio = t[key] / f[key] if f[key] else float("nan")
                ok = ratio <= lim if op == "<=" else ratio >= lim
                verdicts.setdefault(str(load), {}).setdefault(scope, {})[key] = {
                    "ratio": ratio, "target": f"{op} {lim}", "pass": bool(ok)}
                parts.append(f"{label} {ratio:.2f}x ({op}{lim}) {'PASS' if ok else 'FAIL'}")
            lines.append(f"{'':>5} {scope:>8} {'TW/FCFS':>6}  " + "; ".join(parts))
        lines.append("")
    table = "\n".join(lines)
    all_pass = all(v["pass"] for load in loads for v in verdicts[str(load)]["all"].values())
    trace_pass = all(v["pass"] for load in loads for sc in traces for v in verdicts[str(load)][sc].values())
    elapsed = time.time() - t_run
    print()
    print(f"TTFT seconds (arrival -> first token); goodput = req/s with TTFT <= {args.slo}s; "
          f"wstd = mean per-step std dev of admitted weights (tokens); sched ms = mean schedule() time per engine "
          f"step; capacity "
          + ", ".join(f"{k} {v['req_s']:.2f} req/s" for k, v in capacity.items()))
    print(table)
    print(f"overall (all traces pooled, every load): {'PASS' if all_pass else 'FAIL'}; "
          f"per trace: {'PASS' if trace_pass else 'FAIL'}; run time {elapsed / 60:.1f} min")

    result = {
        "benchmark": "bench_scheduler",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "engine": {**ENGINE_KW, "model": f"generated Qwen3, variant {args.model} (float32, CPU)", "VLLM_CPU_KVCACHE_SPACE":
                   os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "traces": {k: {**v, "short_prompt": SHORT_RANGE, "long_prompt": LONG_RANGE, "output": OUT_RANGE}
                   for k, v in TRACE_SPECS.items() if k in traces},
        "requests_per_trace": n, "loads": loads, "slo_s": args.slo,
        "token_weighted_settings": sched_env,
        "capacity": capacity,
        "cost_shape": probe,
        "summary": summary,
        "verdicts": verdicts,
        "pass": all_pass, "pass_per_trace": trace_pass,
        "table": table,
        "run_time_s": elapsed,
        "per_request": {f"x{load}-{policy}": [{t: reps[t]["requests"] for t in traces} for reps in raw[(load, policy)]]
                        for (load, policy) in raw},
        "per_step": {f"x{load}-{policy}": [{t: {"t0": reps[t]["t0"], "comp": reps[t].get("comp", [])} for t in traces}
                                           for reps in raw[(load, policy)]] for (load, policy) in raw},
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")
    try:
        plot(raw, loads, traces, args.slo, out_path[:-5] + ".png")
        print(f"wrote {out_path[:-5] + '.png'}")
    except ImportError:
        print("matplotlib not importable: no PNG")
    return 0 if all_pass else 1


def plot(raw: dict, loads: list[float], traces: list[str], slo: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(loads), len(traces) + 1, figsize=(5 * (len(traces) + 1), 3.8 * len(loads)),
                             squeeze=False)
    colors = {"fcfs": "tab:red", "tw": "tab:blue"}
    for li, load in enumerate(loads):
        for ti, scope in enumerate(traces + ["long decile (all)"]):
            ax = axes[li][ti]
            for policy in POLICIES:
                reps = raw[(load, policy)]
                if scope in traces:
                    vals = [r["ttft"] for runs in reps for r in runs[scope]["requests"]]
                else:
                    vals = []
                    for runs in reps:
                        for t in traces:
                            rs = sorted(runs[t]["requests"], key=lambda r: (r["prompt_len"], r["i"]))
                            vals += [r["ttft"] for r in rs[len(rs) - max(1, len(rs) // 10):]]
                vals.sort()
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", color=colors[policy], label=POLICY_NAMES[policy])
            ax.axvline(slo, color="gray", ls=":", lw=1)
            ax.set_xscale("log")
            ax.set_title(f"{scope} @ {load}x capacity")
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
