#!/usr/bin/env python
"""Token-weighted admission scheduler vs vLLM's FCFS on the real vLLM CPU engine, in one run.

Traces (seeded, the same for both policies at a load level; open-loop Poisson arrivals;
``qwen_vllm_ext.bench.scheduler_traces``, shared with the simulator ``sim_scheduler.py``):

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

Protocol (issue #35: paired observations with intervals; ``--sides A,B``, side 0 the reference):

1. **capacity** — FCFS, each trace's request mix submitted all at once (saturation): sustained requests/s =
   requests / (last completion - first submission); measured once, by two engines placed as in the replays, and
   shared by both sides (``--capacity`` reuses a measured one).
2. **replays** — per repeat, one worker process per side (a fresh engine each: ``fcfs`` = vLLM's ``Scheduler``
   forced, ``tw`` = ``TokenWeightedScheduler``, ``default`` = no ``scheduler_cls``) replays every (load, seed,
   trace) job in the same order. ``--pairing concurrent`` (default): both workers at the same time, each pinned to
   its own core with one OpenMP thread (frontend, load generator and engine core together), the cores swapped every
   repeat, every job started on both at once behind a file barrier — a change in the machine's speed hits both
   sides alike. ``shared``: at the same time, neither pinned. ``sequential``: one side after the other on both
   cores. A job's prompts are salted by its load, so an engine never sees a prompt twice.

One observation = one repeat and seed, traces pooled (and per trace). For each metric the ratio side 1 / side 0
goes into a 95% t interval of the mean log ratio over the observations. A cell (load) passes when the intervals
stay below 1.03 (mean TTFT) and 1.08 (p99 TTFT) and above 0.97 (output throughput); the A/A run
(``--sides fcfs,fcfs``) must pass the same test for an A/B verdict to mean anything. With ``fcfs`` and ``tw`` as the
sides, ``sim_scheduler.predict_paired`` simulates the same traces at the same rates with a step-cost model fitted to
this run's own steps, printed next to the real intervals.

TTFT = first streamed output - scheduled arrival time (a client falling behind its schedule counts against
the engine, as a real client's wait would). Per run: TTFT mean / p50 / p99, p99 TTFT of the longest decile of
requests by prompt length, output tokens/s (output tokens / (last completion - first arrival)), goodput under
a TTFT SLO (requests with TTFT <= ``--slo`` seconds per second of the same span, and their share), and the
mean per-step standard deviation of the weights (uncached prompt tokens + 0.7 x min(max_tokens, cap)) of the
requests a step admits (steps admitting two or more). The admitted weights are recorded in the engine core by a
thin subclass of each scheduler (``BenchFCFSScheduler`` / ``BenchTokenWeightedScheduler`` in this module, which
only observe ``schedule()``'s output), so the figure is computed the same way for both; the token-weighted
scheduler's own ``qwen_stats`` figure is reported too. The same subclasses time ``schedule()`` (the "sched ms"
column), count preemptions, and record every step's composition (requests, tokens, prefill tokens, prefill and
decode context) and where its time went (``schedule()``, the model step, ``update_from_output()``) under
``per_step`` in the raw JSON: ``sim_scheduler.py --fit`` fits its step-cost model to those records.

    .venv/bin/python -m benchmarks.bench_scheduler --quick --model demo          # smoke run, ~1.5 minutes
    .venv/bin/python -m benchmarks.bench_scheduler --model demo --sides fcfs,fcfs --requests 600   # A/A, ~15 min
    .venv/bin/python -m benchmarks.bench_scheduler --model demo --requests 600                     # A/B, ~15 min

(from the repository root: the module imports the simulator, ``benchmarks.sim_scheduler``, for its prediction).

Writes the summary JSON (``--out``, default ``benchmarks/results/bench_scheduler.json``; cells, intervals, the
prediction), the raw JSON (``--raw``: every request and step), a PNG of the TTFT CDFs next to the summary, and the
workers' logs under ``benchmarks/results/bench_scheduler_logs/``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

from qwen_vllm_ext.bench.paired import TARGETS, judge, ratio_interval
# the traces, the engine settings and the per-run metrics (shared with sim_scheduler.py)
from qwen_vllm_ext.bench.scheduler_traces import (ENGINE_KW, LONG_RANGE, OUT_RANGE, SHORT_RANGE, TRACE_SPECS,
                                                  make_arrivals, make_mix, pooled, summarize)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODULE = "benchmarks.bench_scheduler"  # importable in the engine core: ROOT is put on PYTHONPATH
POLICIES = ("fcfs", "tw")
POLICY_NAMES = {"fcfs": "FCFS", "tw": "token-weighted"}
OUTPUT_WEIGHT = 0.7
OUTPUT_CAP = 1024


# ---------------------------------------------------------------------------------------------------------
# Traces (qwen_vllm_ext.bench.scheduler_traces): the prompts
# ---------------------------------------------------------------------------------------------------------
def prompt_ids(req: dict, vocab_size: int = 151936, salt: str = "") -> list[int]:
    """The request's prompt: random ids from its token seed (and the job's salt: one engine replays a trace at
    several loads, and a prompt seen before would hit the prefix cache)."""
    rng = random.Random(f"{req['token_seed']}{salt}" if salt else req["token_seed"])
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
            self._bench_preempted: list[list[float]] = []  # [time, requests preempted by the step]
            self._bench_path = os.environ.get("BENCH_SCHED_STATS", "")
            self._bench_dirty = False
            self._bench_gate_open = 0  # auto: steps the overload gate let the policy order

        def schedule(self, *args, **kwargs):
            t_sched = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            dt_sched = time.perf_counter() - t_sched
            if getattr(self.waiting, "gate", None) is not None:
                self._bench_gate_open += not self.waiting.exact
            # Step composition, the cost-model data of sim_scheduler.py: requests, tokens, prefill tokens, prefill
            # and decode context (qwen_vllm_ext.scheduling.engine_costs.step_composition).
            from qwen_vllm_ext.scheduling.engine_costs import step_composition

            self._bench_comp.append([time.time(), dt_sched, *step_composition(self.requests, out)])
            if out.preempted_req_ids:
                self._bench_preempted.append([time.time(), len(out.preempted_req_ids)])
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
            data = {"steps": self._bench_steps, "comp": self._bench_comp, "preempted": self._bench_preempted,
                    "class": type(self).__mro__[1].__name__}
            stats = getattr(self, "qwen_stats", None)
            if stats is not None:
                data["qwen_stats"] = stats.snapshot()
                data["qwen_policy"] = {k: v for k, v in vars(self.qwen_policy).items()}
                gate = self.waiting.gate
                if gate is not None:
                    data["qwen_gate"] = {"switches": gate.switches, "open_steps": self._bench_gate_open,
                                         "steps": len(self._bench_comp)}
            tmp = self._bench_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self._bench_path)
            self._bench_dirty = False

    Recording.__name__ = Recording.__qualname__ = "Bench" + base.__name__
    return Recording


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):  # PEP 562: vLLM resolves "benchmarks.bench_scheduler.BenchFCFSScheduler" lazily
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
async def _replay(engine, reqs: list[dict], arrivals: list[float], tag: str, vocab_size: int,
                  t0: float | None = None, salt: str = "") -> dict:
    import asyncio

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts = [prompt_ids(r, vocab_size, salt) for r in reqs]
    results: list[dict] = [None] * len(reqs)  # type: ignore[list-item]
    t0 = time.time() + 0.5 if t0 is None else t0

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


SIDE_CLASSES = {"fcfs": "BenchFCFSScheduler", "tw": "BenchTokenWeightedScheduler",
                "auto": "BenchTokenWeightedScheduler", "default": None}
"""A side's scheduler: ``fcfs`` forces vLLM's ``Scheduler`` (through the recording subclass), ``tw`` the
token-weighted one (its policy always on), ``auto`` the same behind its overload gate
(``token_weighted_scheduler=auto``), ``default`` passes no ``scheduler_cls`` (vLLM's own choice on this build; no
per-step records)."""
TOKEN_WEIGHTED_SIDES = ("tw", "auto")


def _barrier(path: str, side: int, k: int, timeout_s: float = 900.0) -> float:
    """Wait for the other side of a concurrent pair to reach job ``k``; both return the same start time (the later
    of the two marker files' mtimes + 1 s)."""
    mine, other = os.path.join(path, f"ready-{k}-{side}"), os.path.join(path, f"ready-{k}-{1 - side}")
    with open(mine, "w"):
        pass
    deadline = time.time() + timeout_s
    while not os.path.exists(other):
        if time.time() > deadline:
            raise SystemExit(f"barrier {k}: the other side never arrived ({other})")
        time.sleep(0.02)
    return max(os.stat(mine).st_mtime, os.stat(other).st_mtime) + 1.0


def worker(spec_path: str, out_path: str) -> None:
    import asyncio

    with open(spec_path) as f:
        spec = json.load(f)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from qwen_vllm_ext.demo import CONFIG, VARIANTS, ensure_demo_model

    vocab = {**CONFIG, **VARIANTS[spec["model"]]}["vocab_size"]
    cls = SIDE_CLASSES[spec["policy"]]
    t_start = time.time()
    extra = {"scheduler_cls": f"{MODULE}.{cls}"} if cls else {}
    args = AsyncEngineArgs(model=str(ensure_demo_model(variant=spec["model"])), disable_log_stats=True, **extra,
                           **ENGINE_KW)
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
        for k, job in enumerate(spec["jobs"]):
            await asyncio.sleep(0.5)
            t0 = _barrier(spec["barrier"], spec["side"], k) if spec.get("barrier") else None
            r = await _replay(engine, job["requests"], job["arrivals"], job["name"], vocab, t0=t0,
                              salt=job.get("salt", ""))
            # The engine core dumps its per-step records once it has no unfinished request.
            deadline = time.time() + 5.0
            steps_data = {}
            while cls and time.time() < deadline:
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
            r["preempted"] = sum(p[1] for p in steps_data.get("preempted", []) if r["t0"] <= p[0] <= r["t_end"] + 0.5)
            r["qwen_stats"] = steps_data.get("qwen_stats")
            r["qwen_policy"] = steps_data.get("qwen_policy")
            r["qwen_gate"] = steps_data.get("qwen_gate")  # cumulative over this worker's jobs so far
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
# Parent: orchestration, metrics (qwen_vllm_ext.bench.scheduler_traces.summarize), report
# ---------------------------------------------------------------------------------------------------------
def start_worker(policy: str, jobs: list[dict], sched_env: dict[str, str], log_name: str, model: str,
                 probe: bool = False, cpu: int | None = None, barrier: str | None = None, side: int = 0) -> dict:
    """Start one worker process: a fresh engine with ``policy``'s scheduler (``SIDE_CLASSES``) replaying ``jobs``
    in order. ``cpu``: pin the whole worker (frontend, load generator and engine core, one OpenMP thread) to that
    core; -1: one OpenMP thread, not pinned. ``barrier``: a directory shared with the other side of a concurrent
    pair (every job starts on both at once)."""
    os.makedirs(os.path.join(RESULTS, "bench_scheduler_logs"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-sched-")
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
    with open(spec_path, "w") as f:
        json.dump({"policy": policy, "jobs": jobs, "model": model, "probe": probe, "barrier": barrier, "side": side}, f)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # the `benchmarks` package
    env["BENCH_SCHED_STATS"] = os.path.join(tmp, "steps.json")
    env["QWEN_VLLM_EXT_INSTANCE_DIR"] = os.path.join(tmp, "instance")
    # the class comes from scheduler_cls; the setting says only whether the policy sits behind the overload gate
    env["QWEN_VLLM_EXT_TOKEN_WEIGHTED_SCHEDULER"] = "auto" if policy == "auto" else "0"
    env.pop("QWEN_VLLM_EXT_SETTINGS", None)  # resolve sched_* from the environment below
    for k in list(env):
        if k.startswith("QWEN_VLLM_EXT_SCHED_"):
            del env[k]
    env.update(sched_env)
    cmd = [sys.executable, "-m", MODULE, "--worker", spec_path, out_path]
    if cpu is not None and cpu >= 0:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
        cmd = ["taskset", "-c", str(cpu)] + cmd
    elif cpu is not None:  # -1: one OpenMP thread, unpinned (the two sides share both cores)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = "1"
    log_path = os.path.join(RESULTS, "bench_scheduler_logs", f"{log_name}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return {"proc": proc, "log": log, "log_path": log_path, "out_path": out_path, "t": time.time(), "name": log_name}


def finish_workers(handles: list[dict]) -> list[dict]:
    """Wait for workers started together; a failing one stops the others (a concurrent pair would wait at its
    barrier)."""
    pending = list(handles)
    while pending:
        for h in list(pending):
            rc = h["proc"].poll()
            if rc is None:
                continue
            pending.remove(h)
            h["log"].close()
            if rc != 0 or not os.path.exists(h["out_path"]):
                for other in pending:
                    other["proc"].kill()
                with open(h["log_path"]) as f:
                    tail = f.read()[-3000:]
                raise SystemExit(f"worker {h['name']} failed (rc={rc}); log {h['log_path']}:\n{tail}")
        time.sleep(0.2)
    outs = []
    for h in handles:
        with open(h["out_path"]) as f:
            out = json.load(f)
        out["wall_s"] = time.time() - h["t"]
        print(f"  [{h['name']}] {out['wall_s']:.0f}s (engine start {out['startup_s']:.0f}s)", flush=True)
        outs.append(out)
    return outs


def run_worker(policy: str, jobs: list[dict], sched_env: dict[str, str], log_name: str, model: str,
               probe: bool = False) -> dict:
    """One worker process, waited for."""
    return finish_workers([start_worker(policy, jobs, sched_env, log_name, model, probe)])[0]


def fmt(x, nd=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


REPORTED = (("ttft_p50_s", "p50"), ("long_decile_p99_ttft_s", "long p99"), ("goodput_req_s", "goodput"))
"""Ratios reported with intervals but not judged (TARGETS are: qwen_vllm_ext.bench.paired)."""


def analyse(obs: list[dict], loads: list[float], traces: list[str], slo: float) -> dict:
    """Per load and scope (each trace, and ``all``: a repeat-and-seed's traces pooled), the paired ratios side 1 /
    side 0 of every metric with their intervals, the sides' mean figures, and the verdict."""
    cells: dict = {}
    for load in loads:
        for scope in traces + ["all"]:
            groups: dict = {}
            for o in obs:
                if o["load"] != load or (scope != "all" and o["trace"] != scope):
                    continue
                groups.setdefault((o["rep"], o["seed"], o["trace"] if scope != "all" else ""), []).append(o)
            pairs = []
            for key in sorted(groups):
                g = groups[key]
                sides = [summarize(pooled([o["runs"][i] for o in g]) if scope == "all" else g[0]["runs"][i], slo)
                         for i in (0, 1)]
                pairs.append(sides)
            metrics = {}
            for key in [t[0] for t in TARGETS] + [r[0] for r in REPORTED]:
                metrics[key] = ratio_interval([b[key] / a[key] if a[key] else float("nan") for a, b in pairs])
            side_means = []
            for i in (0, 1):
                vals: dict = {}
                for p in pairs:
                    for k, v in p[i].items():
                        if isinstance(v, (int, float)) and v is not None:
                            vals.setdefault(k, []).append(v)
                side_means.append({k: sum(v) / len(v) for k, v in vals.items()})
            cells.setdefault(str(load), {})[scope] = {"metrics": metrics, "sides": side_means, **judge(metrics),
                                                     "observations": len(pairs)}
    return cells


def fmt_iv(iv: dict) -> str:
    return f"{fmt(iv['point'])} [{fmt(iv['lo'])}, {fmt(iv['hi'])}]"


def report(cells: dict, loads: list[float], traces: list[str], sides: list[str], prediction: dict | None) -> str:
    lines = [f"ratios {sides[1]} / {sides[0]}: point [95% interval] over paired observations; pass = interval inside "
             "mean <= 1.03, p99 <= 1.08, tput >= 0.97 (points: <= 1.0, <= 1.05, >= 0.98)"]
    for load in loads:
        for scope in traces + ["all"]:
            c = cells[str(load)][scope]
            m = c["metrics"]
            a, b = c["sides"]
            sim = ""
            if prediction and scope == "all":
                p = prediction["cells"].get(str(load), {})
                sim = "  sim " + " ".join(f"{lab} {fmt(p.get(k))}" for k, lab, *_ in TARGETS)
            lines.append(f"{load:>4}x {scope:>8} n={c['observations']:<2} "
                         + "  ".join(f"{lab} {fmt_iv(m[k])}" for k, lab, *_ in TARGETS)
                         + f"  {'PASS' if c['pass'] else 'FAIL'}{' (points pass)' if c['pass_point'] and not c['pass'] else ''}"
                         + sim)
            lines.append(f"{'':>14}" + "  ".join(f"{lab} {fmt_iv(m[k])}" for k, lab in REPORTED)
                         + f"  | mean TTFT {fmt(a['ttft_mean_s'])}/{fmt(b['ttft_mean_s'])} s, tok/s "
                         f"{fmt(a['output_tok_s'], 0)}/{fmt(b['output_tok_s'], 0)}, sched ms/step "
                         f"{fmt(a.get('schedule_ms_per_step'))}/{fmt(b.get('schedule_ms_per_step'))}, steps "
                         f"{fmt(a.get('engine_steps'), 0)}/{fmt(b.get('engine_steps'), 0)}, preempted "
                         f"{fmt(a.get('preempted'), 1)}/{fmt(b.get('preempted'), 1)}")
        lines.append("")
    return "\n".join(lines)


def measure_capacity(args, traces: list[str], n_cap: int) -> tuple[dict, dict | None]:
    """Saturation throughput (FCFS, every request at t=0), shared by both sides: with concurrent or shared pairs,
    measured by two engines at once (placed as in the replays) and averaged."""
    jobs = []
    for kind in traces:
        mix = make_mix(kind, n_cap, args.seed_base + 1000)
        jobs.append({"name": f"cap-{kind}", "requests": mix, "arrivals": [0.0] * len(mix)})
    if args.pairing in ("concurrent", "shared"):
        barrier = tempfile.mkdtemp(prefix="bench-sched-barrier-")
        outs = finish_workers([start_worker("fcfs", jobs, {}, f"capacity-cpu{i}", args.model, probe=True,
                                            cpu=i if args.pairing == "concurrent" else -1, barrier=barrier, side=i)
                               for i in (0, 1)])
    else:
        outs = [run_worker("fcfs", jobs, {}, "capacity", args.model, probe=True)]
    capacity = {}
    for t, kind in enumerate(traces):
        per = []
        for out in outs:
            run = out["runs"][t]
            span = run["t_end"] - run["t0"]
            per.append({"req_s": len(run["requests"]) / span,
                        "output_tok_s": sum(r["out_tokens"] for r in run["requests"]) / span})
        capacity[kind] = {"req_s": sum(p["req_s"] for p in per) / len(per),
                          "output_tok_s": sum(p["output_tok_s"] for p in per) / len(per), "per_side": per}
        print(f"  capacity {kind}: {capacity[kind]['req_s']:.2f} req/s ("
              + " / ".join(f"{p['req_s']:.2f}" for p in per) + ")", flush=True)
    probe = outs[0]["probe"]
    print(f"  cost shape: a 2,000-token prefill alone {probe['prefill_2000_s'] * 1000:.0f} ms, a decode step of "
          f"{ENGINE_KW['max_num_seqs']} requests {probe['decode_step_s'] * 1000:.1f} ms "
          f"(ratio {probe['prefill_over_decode_step']:.1f})", flush=True)
    return capacity, probe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke run (60 requests, one load, one seed, one repeat)")
    ap.add_argument("--sides", default="fcfs,tw",
                    help="the pair, side 0 (the reference) then side 1: fcfs (vLLM's Scheduler, forced), tw (the "
                         "token-weighted scheduler), default (no --scheduler-cls). fcfs,fcfs is the A/A run "
                         "(default fcfs,tw)")
    ap.add_argument("--pairing", choices=("concurrent", "shared", "sequential"), default="concurrent",
                    help="concurrent (default): both sides replay every trace at the same time, each engine pinned to "
                         "its own core, the cores swapped every repeat, so a change in the machine's speed hits both "
                         "alike; shared: at the same time, one OpenMP thread each, neither pinned (both share both "
                         "cores); sequential: one side after the other on both cores, the order alternating by repeat")
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default 300, quick 60)")
    ap.add_argument("--cap-requests", type=int, default=None, help="requests per capacity run (default 120)")
    ap.add_argument("--loads", default=None, help="load levels, x capacity (default 0.8,1.2,1.7; quick 1.2)")
    ap.add_argument("--traces", default="longtail,burst")
    ap.add_argument("--seeds", default=None, help="trace seeds replayed per repeat (default 0,1,2; quick 0)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="worker pairs, one after the other (concurrent: cores swapped between them; default 2, "
                         "quick 1)")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds (default 2.0)")
    ap.add_argument("--seed-base", type=int, default=0, help="offset of the capacity mix's seed")
    ap.add_argument("--capacity", default=None,
                    help="skip the capacity phase: req/s per trace, e.g. longtail=5.1,burst=6.0")
    ap.add_argument("--sched", action="append", default=[],
                    help="QWEN_VLLM_EXT_SCHED_*=VALUE for the token-weighted engine (repeatable)")
    ap.add_argument("--model", default="prefill-bench", choices=("prefill-bench", "demo"),
                    help="generated model variant (qwen_vllm_ext.demo.VARIANTS): prefill-bench (default; a long "
                         "prefill costs tens of full decode steps, as for a mid-size model on a GPU) or demo (the "
                         "tiny demo model: decode-slot-bound)")
    ap.add_argument("--no-predict", action="store_true",
                    help="skip the simulator's prediction of the same traces (fcfs,tw runs only)")
    ap.add_argument("--out", default=None,
                    help="summary JSON: intervals, verdicts, prediction (default benchmarks/results/bench_scheduler"
                         "[_quick].json)")
    ap.add_argument("--raw", default=None,
                    help="full JSON with every request and engine step, for sim_scheduler.py --fit (default: --out "
                         "with .raw.json under benchmarks/results/)")
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0

    t_run = time.time()
    n = args.requests or (60 if args.quick else 300)
    n_cap = args.cap_requests or (60 if args.quick else 120)
    loads = [float(x) for x in (args.loads or ("1.2" if args.quick else "0.8,1.2,1.7")).split(",")]
    seeds = [int(x) for x in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    repeats = args.repeats or (1 if args.quick else 2)
    traces = [t for t in args.traces.split(",") if t]
    sides = args.sides.split(",")
    if len(sides) != 2 or any(x not in SIDE_CLASSES for x in sides):
        raise SystemExit(f"--sides {args.sides!r}: two of {', '.join(SIDE_CLASSES)}")
    sched_env = dict(kv.split("=", 1) for kv in args.sched)
    predict = sides[0] != sides[1] and sorted(sides) in (["fcfs", "tw"], ["auto", "fcfs"]) and not args.no_predict
    if predict and importlib.util.find_spec("benchmarks") is None:  # imported after the run: checked before it
        raise SystemExit("the prediction imports benchmarks.sim_scheduler: run python -m benchmarks.bench_scheduler "
                         "from the repository root (or pass --no-predict)")
    out_path = args.out or os.path.join(RESULTS, "bench_scheduler_quick.json" if args.quick else "bench_scheduler.json")
    raw_path = args.raw or os.path.join(RESULTS, os.path.basename(out_path)[:-5] + ".raw.json")
    os.makedirs(RESULTS, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tag = f"{args.model}-" + "-".join(sides)
    print(f"bench_scheduler: {args.model}, sides {sides} ({args.pairing}), {n} requests/trace, traces {traces}, "
          f"loads {loads}, seeds {seeds}, repeats {repeats}, token-weighted settings {sched_env or 'defaults'}",
          flush=True)

    # 1. Capacity (FCFS, all requests at t=0): measured once, shared by both sides.
    probe = None
    if args.capacity:
        capacity = {k: {"req_s": float(v)} for k, v in (kv.split("=") for kv in args.capacity.split(","))}
    else:
        print("capacity phase (FCFS, saturation)...", flush=True)
        capacity, probe = measure_capacity(args, traces, n_cap)

    # 2. Replays: per repeat, one worker per side replays every (load, seed, trace) job in the same order.
    obs: list[dict] = []
    for rep in range(repeats):
        jobs, keys = [], []
        for load in loads:
            for seed in seeds:
                for kind in traces:
                    rate = load * capacity[kind]["req_s"]
                    jobs.append({"name": f"{kind}-x{load}-s{seed}", "requests": make_mix(kind, n, seed),
                                 "arrivals": make_arrivals(kind, n, rate, seed), "salt": f"-x{load}"})
                    keys.append((load, seed, kind))
        env = [sched_env if s in TOKEN_WEIGHTED_SIDES else {} for s in sides]
        print(f"repeat {rep + 1}/{repeats}: {len(jobs)} jobs per side...", flush=True)
        if args.pairing in ("concurrent", "shared"):
            cpus = ((0, 1) if rep % 2 == 0 else (1, 0)) if args.pairing == "concurrent" else (-1, -1)
            barrier = tempfile.mkdtemp(prefix="bench-sched-barrier-")
            outs = finish_workers([start_worker(sides[i], jobs, env[i], f"{tag}-r{rep + 1}-side{i}-{sides[i]}-cpu{cpus[i]}",
                                                args.model, cpu=cpus[i], barrier=barrier, side=i) for i in (0, 1)])
        else:
            cpus = (None, None)
            outs = [None, None]
            for i in ((0, 1) if rep % 2 == 0 else (1, 0)):
                outs[i] = run_worker(sides[i], jobs, env[i], f"{tag}-r{rep + 1}-side{i}-{sides[i]}", args.model)
        for j, (load, seed, kind) in enumerate(keys):
            obs.append({"rep": rep, "load": load, "seed": seed, "trace": kind, "cpus": list(cpus),
                        "runs": [outs[0]["runs"][j], outs[1]["runs"][j]]})

    # 3. Paired ratios with intervals, the simulator's prediction for the same traces, the verdict.
    cells = analyse(obs, loads, traces, args.slo)
    raw = {"paired": True, "model": args.model, "sides": sides, "loads": loads, "seeds": seeds, "traces": traces,
           "requests_per_trace": n, "capacity": capacity,
           # the simulator's reading of the token-weighted side (sim_scheduler.parse_config: mode=auto gates it)
           "token_weighted_settings": {**sched_env, **({"mode": "auto"} if "auto" in sides else {})},
           "engine": ENGINE_KW, "observations": obs,
           # sim_scheduler.py --fit reads the per-step records here (one list per replay).
           "per_step": {f"x{o['load']}-{sides[i]}": [] for o in obs for i in (0, 1)}}
    for o in obs:
        for i in (0, 1):
            raw["per_step"][f"x{o['load']}-{sides[i]}"].append({o["trace"]: {"t0": o["runs"][i]["t0"],
                                                                              "comp": o["runs"][i].get("comp", [])}})
    prediction = None
    if predict:
        from benchmarks.sim_scheduler import predict_paired  # the simulator, on the same traces at the same rates

        flip = sides[0] in TOKEN_WEIGHTED_SIDES
        prediction = predict_paired(raw, args.slo, invert=flip)
    table = report(cells, loads, traces, sides, prediction)
    all_pass = all(cells[str(load)]["all"]["pass"] for load in loads)
    elapsed = time.time() - t_run
    print()
    print(table)
    print(f"overall (traces pooled, every load): {'PASS' if all_pass else 'FAIL'}; run time {elapsed / 60:.1f} min")
    result = {
        "benchmark": "bench_scheduler", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python -m benchmarks.bench_scheduler"] + sys.argv[1:]),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "engine": {**ENGINE_KW, "model": f"generated Qwen3, variant {args.model} (float32, CPU)",
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
        "sides": sides, "pairing": args.pairing, "loads": loads, "seeds": seeds, "repeats": repeats,
        "traces": {k: {**v, "short_prompt": SHORT_RANGE, "long_prompt": LONG_RANGE, "output": OUT_RANGE}
                   for k, v in TRACE_SPECS.items() if k in traces},
        "requests_per_trace": n, "slo_s": args.slo, "token_weighted_settings": sched_env,
        "capacity": capacity, "cost_shape": probe, "targets": TARGETS,
        "cells": cells, "prediction": prediction, "pass": all_pass, "table": table, "run_time_s": elapsed,
        "raw": os.path.relpath(raw_path, ROOT),
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    with open(raw_path, "w") as f:
        json.dump(raw, f)
    print(f"wrote {out_path} and {raw_path}")
    try:
        plot(obs, loads, sides, args.slo, out_path[:-5] + ".png")
        print(f"wrote {out_path[:-5] + '.png'}")
    except ImportError:
        print("matplotlib not importable: no PNG")
    return 0 if all_pass else 1


def plot(obs: list[dict], loads: list[float], sides: list[str], slo: float, path: str) -> None:
    """TTFT CDFs of both sides per load (all requests, and the longest decile), every observation pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(loads), 2, figsize=(10, 3.8 * len(loads)), squeeze=False)
    colors = ("tab:red", "tab:blue")
    for li, load in enumerate(loads):
        for ci, scope in enumerate(("all requests", "longest decile")):
            ax = axes[li][ci]
            for i in (0, 1):
                vals = []
                for o in obs:
                    if o["load"] != load:
                        continue
                    rs = o["runs"][i]["requests"]
                    if scope == "longest decile":
                        rs = sorted(rs, key=lambda r: (r["prompt_len"], r["i"]))[len(rs) - max(1, len(rs) // 10):]
                    vals += [r["ttft"] for r in rs]
                vals.sort()
                ax.step(vals, [(k + 1) / len(vals) for k in range(len(vals))], where="post", color=colors[i],
                        label=f"side {i}: {sides[i]}")
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
