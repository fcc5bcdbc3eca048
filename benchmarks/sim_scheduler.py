#!/usr/bin/env python
"""Simulate ``bench_scheduler.py``'s traces through the real vLLM schedulers on a virtual clock, in seconds.

vLLM's own ``Scheduler`` (FCFS) and the token-weighted one are driven without a model
(``qwen_vllm_ext.scheduling.sim``); each step's duration comes from a linear cost model fitted to a real engine's
per-step records (``--fit``: a ``bench_scheduler.py`` results JSON, which records every step's composition). Use
it to explore policy settings; confirm on the real engine with ``bench_scheduler.py``. ``--fit`` also replays the
real run's traces at its rates and prints simulated next to measured figures, so the model's fidelity is visible.

    .venv/bin/python -m benchmarks.sim_scheduler --fit benchmarks/results/bench_scheduler.json
    .venv/bin/python -m benchmarks.sim_scheduler --fit benchmarks/results/bench_scheduler.json \\
        --seeds 0,1,2 --config fixed:AGING_LOAD_EXPONENT=0 --config scaled2:AGING_HALF_LIFE_S=0.6,AGING_LOAD_EXPONENT=2

``--config NAME:KEY=VALUE,...`` (repeatable) names a token-weighted configuration; keys are ``sched_*`` settings
without the prefix (``QWEN_VLLM_EXT_SCHED_`` spelling accepted), and ``mode=auto`` puts it behind the overload gate
(``token_weighted_scheduler=auto``; default ``mode=true``). Without ``--config``: the shipped defaults, always on.
``--speed 0.5,1,2`` repeats the sweep with every step's cost divided by each factor — an engine half or twice as
fast — to show how a setting depends on the engine's speed (capacity and rates are re-measured at each speed).

``--cost-model NAME`` replaces the fitted model with a stored one of ``benchmarks/cost_models.json``: ``a100-80gb``
and ``h100-80gb``, GPU step-cost models for a Qwen3-8B-class model built from public measured kernel profiles (sources
in docs/results/scheduler.md), run with that launcher profile's batch limits (``max_num_seqs``,
``max_num_batched_tokens``); ``cpu-demo`` and ``cpu-prefill-bench``, the models fitted to this machine's real
``bench_scheduler.py`` runs of the two CPU benchmark models (the command that fitted each is stored with it), run with
the CPU benchmark's batch limits. No fidelity section (there is no real run to compare with):

    .venv/bin/python -m benchmarks.sim_scheduler --cost-model a100-80gb --loads 0.8,1.2,1.7 --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# traces, engine settings, metrics: the same code as the real benchmark (bench_scheduler.py)
from qwen_vllm_ext.bench.scheduler_traces import ENGINE_KW, make_arrivals, make_mix, pooled, summarize  # noqa: E402
from qwen_vllm_ext.scheduling.policy import SETTING_PREFIX, PolicyConfig  # noqa: E402
from qwen_vllm_ext.scheduling.sim import StepCostModel, fit_cost_model, simulate  # noqa: E402

# (summary key, label, comparison, limit on the ratio to FCFS; None: reported, not a target). The limits are the
# "never worse than FCFS" targets of issue #21: mean TTFT <= 1.0x, p99 TTFT of all requests <= 1.05x, throughput
# >= 0.98x.
METRICS = (("ttft_mean_s", "mean", "<=", 1.0), ("ttft_p50_s", "p50", "<=", None), ("ttft_p99_s", "p99", "<=", 1.05),
           ("long_decile_p99_ttft_s", "long p99", "<=", None), ("output_tok_s", "tok/s", ">=", 0.98),
           ("goodput_req_s", "goodput", ">=", None))
OVERLOAD_TARGETS = (("ttft_mean_s", "<=", 1.0), ("ttft_p99_s", "<=", 1.02), ("long_decile_p99_ttft_s", "<=", 1.05),
                    ("output_tok_s", ">=", 0.99))
"""Issue #50's targets for ``token_weighted_scheduler=auto`` against FCFS, held by the median over seeds on every
trace at every load (below the gate the ratios are 1 by construction): mean TTFT <= 1.00x, p99 <= 1.02x,
longest-decile p99 <= 1.05x, throughput >= 0.99x."""
COST_MODELS = os.path.join(HERE, "cost_models.json")


def ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else float("inf"))


def parse_config(text: str) -> tuple[str, PolicyConfig, bool]:
    """``NAME:KEY=VALUE,...`` -> (NAME, the policy, behind the overload gate): values parsed and checked by the
    settings object itself."""
    from qwen_vllm_ext.config import Settings, SettingsError

    name, _, body = text.partition(":")
    values = {}
    mode = "true"
    for kv in filter(None, body.split(",")):
        key, _, value = kv.partition("=")
        if key.strip().lower() in ("mode", "token_weighted_scheduler"):
            mode = value.strip().lower()
            if mode not in ("true", "auto"):
                raise SystemExit(f"--config {text!r}: mode must be true or auto, got {value!r}")
            continue
        field = key.strip().lower().removeprefix("qwen_vllm_ext_").removeprefix(SETTING_PREFIX)
        known = [f.name for f in dataclasses.fields(PolicyConfig)]
        if field not in known:
            raise SystemExit(f"--config {text!r}: unknown setting {field!r}; known: " + ", ".join(known))
        values[SETTING_PREFIX + field] = value
    try:
        return name or "tw", Settings.resolve(env={}, cli=values).scheduler, mode == "auto"
    except SettingsError as exc:
        raise SystemExit(f"--config {text!r}: {exc}") from None


ENGINE = {k: ENGINE_KW[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
"""The simulated engine's batch limits: the CPU benchmark's, or a GPU profile's with ``--cost-model``."""


WARM: dict = {}
"""Per trace kind, the capacity run's step-cost fit: the token-weighted runs start from it (an engine that has
been serving that traffic), not from an empty fit."""


def run_traces(model_dir: str, traces: list[str], n: int, rates: dict[str, float], cost: StepCostModel, seed: int,
               token_weighted: bool, policy: PolicyConfig | None, auto: bool = False) -> dict[str, dict]:
    out = {}
    for kind in traces:
        out[kind] = simulate(model_dir, make_mix(kind, n, seed), make_arrivals(kind, n, rates[kind], seed),
                             cost, token_weighted=token_weighted, policy=policy, warm=WARM.get(kind), auto=auto,
                             **ENGINE)
    return out


def stored_cost_model(name: str) -> tuple[StepCostModel, dict]:
    """The step-cost model ``name`` of cost_models.json and its engine's batch limits: the entry's own ``engine``
    (the CPU fits), else the launcher profile ``name``'s (the GPU models)."""
    from qwen_vllm_ext.profiles import load_profile

    with open(COST_MODELS) as f:
        models = json.load(f)
    if name not in models or name == "notes":
        raise SystemExit(f"--cost-model {name!r}: known: {', '.join(k for k in models if k != 'notes')}")
    m = models[name]
    cost = StepCostModel(*(float(m[f.name]) for f in dataclasses.fields(StepCostModel)))
    if "engine" in m:
        return cost, dict(m["engine"])
    vllm = load_profile(name).vllm
    return cost, {"max_num_seqs": int(vllm["max-num-seqs"]), "max_num_batched_tokens": int(vllm["max-num-batched-tokens"]),
                  "max_model_len": 4096}


def summaries(runs: dict[str, dict], traces: list[str], slo: float) -> dict[str, dict]:
    s = {kind: summarize(runs[kind], slo) for kind in traces}
    s["all"] = summarize(pooled([runs[k] for k in traces]), slo)
    return s


def engine_time_check(real: dict) -> dict:
    """Where the real run's engine time went, per load and policy (all repeats and traces): steps, measured step
    time against the common cost model's prediction, the same step sequences priced by a model fitted to each
    policy's own steps, and the drain tail (from the last prefill step to the last completion)."""
    per: dict = {}
    for key, reps in real["per_step"].items():
        load, policy = key[1:].split("-")
        for r, rep in enumerate(reps):
            for trace, v in rep.items():
                comp = v["comp"]
                if len(comp) < 2:
                    continue
                reqs = real["per_request"][key][r][trace]
                last_pre = max(i for i, c in enumerate(comp) if c[4] > 0)
                tail = comp[last_pre:]
                x = per.setdefault((load, policy), {"records": [], "priced": [], "steps": 0, "measured": 0.0,
                                                    "tail_s": [], "tail_step_ms": []})
                x["records"] += comp + [[comp[-1][0] + 1e6, 0, 0, 0, 0, 0]]  # runs kept apart (see main)
                x["priced"] += comp[:-1]  # the steps whose duration was measured
                x["steps"] += len(comp)
                x["measured"] += sum(b[0] - a[0] for a, b in zip(comp, comp[1:]))
                x["tail_s"].append(max(q["done"] for q in reqs) - tail[0][0])
                if len(tail) > 2:
                    x["tail_step_ms"].append(1000 * (tail[-1][0] - tail[1][0]) / (len(tail) - 2))
    common, _ = fit_cost_model([row for x in per.values() for row in x["records"]])
    own = {k: fit_cost_model(x["records"])[0] for k, x in per.items()}
    out = {}
    print("\nengine time of the real run (all repeats and traces; predicted = the common cost model):")
    for (load, policy), x in sorted(per.items()):
        steps = x["priced"]
        predicted = sum(common.price(c) for c in steps)
        other = "tw" if policy == "fcfs" else "fcfs"
        own_price = {p: sum(own[(load, p)].price(c) for c in steps) for p in (policy, other)
                     if (load, p) in own}
        out[f"{load}-{policy}"] = {"steps": x["steps"], "measured_s": x["measured"], "predicted_s": predicted,
                                   "own_model_s": own_price, "tail_s": x["tail_s"], "tail_step_ms": x["tail_step_ms"]}
        print(f"  {load}x {policy:>4}: {x['steps']} steps, measured {x['measured']:.1f} s / predicted {predicted:.1f} s "
              f"({x['measured'] / predicted:.3f}); these steps priced by each policy's own fit: "
              + ", ".join(f"{p} {v:.1f} s" for p, v in own_price.items())
              + f"; drain tail {min(x['tail_s']):.2f}-{max(x['tail_s']):.2f} s of "
              f"{min(x['tail_step_ms'], default=0):.1f}-{max(x['tail_step_ms'], default=0):.1f} ms steps", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fit", help="bench_scheduler.py results JSON with per-step records")
    src.add_argument("--cost-model", help="a stored step-cost model of cost_models.json (a100-80gb, h100-80gb, h200-141gb, cpu-demo, "
                     "cpu-prefill-bench)")
    ap.add_argument("--config", action="append", default=[], help="NAME:KEY=VALUE,... token-weighted configuration")
    ap.add_argument("--loads", default="1.2,1.7")
    ap.add_argument("--traces", default="longtail,burst")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seeds", default="0", help="trace seeds (comma-separated): results pooled per seed, shown each")
    ap.add_argument("--slo", type=float, default=2.0)
    ap.add_argument("--model", default="prefill-bench")
    ap.add_argument("--speed", default="1",
                    help="engine speed factors for the sweep (comma-separated): every step cost divided by it, so 2 "
                         "emulates a machine twice as fast (capacity and rates are measured at each speed)")
    ap.add_argument("--save-cost-model", metavar="NAME",
                    help="with --fit: store the fitted model in cost_models.json as NAME (with the CPU benchmark's "
                         "batch limits, the fit statistics and this command), for --cost-model NAME")
    ap.add_argument("--out", help="results JSON (default: benchmarks/results/sim_scheduler[_<cost model>].json)")
    args = ap.parse_args()

    from qwen_vllm_ext.demo import ensure_demo_model

    model_dir = str(ensure_demo_model(variant=args.model))
    traces = [t for t in args.traces.split(",") if t]
    loads = [float(x) for x in args.loads.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    configs = [parse_config(c) for c in args.config] or [("default", PolicyConfig(), False)]
    t_start = time.time()
    fidelity = engine_time = None
    if args.cost_model:
        cost, engine = stored_cost_model(args.cost_model)
        ENGINE.update(engine)
        stats = {"cost_model": args.cost_model, "engine": engine}
        print(f"cost model {args.cost_model} (s/step) = {cost.base * 1e3:.2f} ms + {cost.per_request * 1e3:.4f} "
              f"ms/request + {cost.per_token * 1e6:.2f} us/token + {cost.per_ctx * 1e9:.2f} ns/(token x context) + "
              f"{cost.per_decode_ctx * 1e9:.1f} ns/decode-context token; engine {engine}", flush=True)
    else:
        cost, stats, fidelity, engine_time = fit_and_check(args, model_dir, traces)
        if args.save_cost_model:
            save_cost_model(args.save_cost_model, cost, stats)
    table = {}
    caps = {}
    for speed in [float(x) for x in args.speed.split(",")]:
        scaled = StepCostModel(*(v / speed for v in dataclasses.astuple(cost)))
        # Capacity in the simulator (FCFS, all at once), then the configurations at each load.
        cap, warm = simulated_capacity(model_dir, traces, scaled, ENGINE)
        WARM.update(warm)
        caps[str(speed)] = cap
        print(f"\nspeed {speed:g}: simulated capacity " + ", ".join(f"{k} {v:.2f} req/s" for k, v in cap.items()))
        sweep(args, model_dir, traces, loads, seeds, configs, scaled, cap, speed, table)
    medians = median_table(table)
    intervals = interval_table(table, traces)
    print(f"({time.time() - t_start:.0f} s)")
    out = args.out or os.path.join(RESULTS, "sim_scheduler" + (f"_{args.cost_model}" if args.cost_model else "")
                                   + ".json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"cost_model": dataclasses.asdict(cost), "fit": stats,
                   "fidelity": fidelity, "engine_time": engine_time, "capacity": caps, "ratios": table, "medians": medians,
                   "intervals": intervals,
                   "configs": {n: {**vars(c), "mode": "auto" if a else "true"} for n, c, a in configs}, "engine": ENGINE, "loads": loads, "seeds": seeds,
                   "traces": traces, "command": " ".join(sys.argv)}, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


def median_table(table: dict) -> dict:
    """Per configuration, speed and load: the median over trace seeds of each pooled ratio, and whether the medians
    meet every never-worse limit of METRICS (printed as a table)."""
    import statistics

    out: dict = {}
    print("\nmedian over seeds (pooled ratios, token-weighted / FCFS; never-worse limits: "
          + ", ".join(f"{label} {op} {lim}" for _, label, op, lim in METRICS if lim is not None) + ")")
    for name, rows in table.items():
        groups: dict = {}
        for key, row in rows.items():
            speed, _seed, load = key.split("-")
            groups.setdefault(f"{speed}-{load}", []).append(row["all"])
        for key, group in sorted(groups.items()):
            med = {m: statistics.median(r[m] for r in group) for m, *_ in METRICS}
            ok = all((med[m] <= lim) if op == "<=" else (med[m] >= lim) for m, _, op, lim in METRICS if lim is not None)
            out.setdefault(name, {})[key] = {**med, "never_worse": ok, "seeds": len(group)}
            speed, load = key.split("-")
            print(f"  {name:>14} {'' if speed == '1' else f'speed {speed} '}{load}x: " + "  ".join(
                f"{label} {med[m]:.2f}" for m, label, *_ in METRICS) + ("  never-worse" if ok else ""), flush=True)
    return out


def interval_table(table: dict, traces: list[str]) -> dict:
    """Per configuration, speed, load and trace (and pooled, ``all``): the 95% interval over seeds of each ratio
    (``qwen_vllm_ext.bench.paired.ratio_interval``: geometric mean and Student t on the log ratio), the median, and
    whether the medians meet :data:`OVERLOAD_TARGETS` on every trace (``targets_met``; printed)."""
    import statistics

    from qwen_vllm_ext.bench.paired import ratio_interval

    out: dict = {}
    print("\n95% intervals over seeds, per trace (issue #50's targets on the medians: "
          + ", ".join(f"{m} {op} {lim}" for m, op, lim in OVERLOAD_TARGETS) + ")")
    for name, rows in table.items():
        groups: dict = {}
        for key, row in rows.items():
            speed, _seed, load = key.split("-")
            groups.setdefault(f"{speed}-{load}", []).append(row)
        for key, group in sorted(groups.items(), key=lambda kv: [float(x) for x in kv[0].split("-")]):
            cell: dict = {}
            for scope in traces + ["all"]:
                cell[scope] = {}
                for m, *_ in METRICS:
                    values = [r[scope][m] for r in group]
                    iv = ratio_interval(values) if len(values) > 1 else {"point": values[0], "lo": values[0],
                                                                         "hi": values[0], "n": 1}
                    cell[scope][m] = {**iv, "median": statistics.median(values)}
            met = all((cell[t][m]["median"] <= lim) if op == "<=" else (cell[t][m]["median"] >= lim)
                      for t in traces for m, op, lim in OVERLOAD_TARGETS)
            gates = [r["gate"] for r in group if r.get("gate")]
            cell["targets_met"] = met
            cell["gate_open_share"] = (sum(g["overloaded_steps"] for g in gates) / max(sum(g["steps"] for g in gates), 1)
                                       if gates else None)
            out.setdefault(name, {})[key] = cell
            speed, load = key.split("-")
            print(f"  {name:>10} {load}x: " + " | ".join(
                f"{t}: mean {cell[t]['ttft_mean_s']['point']:.2f} [{cell[t]['ttft_mean_s']['lo']:.2f}, "
                f"{cell[t]['ttft_mean_s']['hi']:.2f}] long p99 {cell[t]['long_decile_p99_ttft_s']['point']:.2f} "
                f"[{cell[t]['long_decile_p99_ttft_s']['lo']:.2f}, {cell[t]['long_decile_p99_ttft_s']['hi']:.2f}]"
                for t in traces) + ("  targets met" if met else "")
                + (f"  gate open {cell['gate_open_share']:.0%} of steps" if gates else ""), flush=True)
    return out


def save_cost_model(name: str, cost: StepCostModel, stats: dict) -> None:
    """Store a fitted model in cost_models.json (replacing an entry of that name; the GPU models are refused)."""
    with open(COST_MODELS) as f:
        models = json.load(f)
    if name in models and "engine" not in models[name] or name == "notes":
        raise SystemExit(f"--save-cost-model {name!r}: a stored GPU model or the notes; pick another name")
    models[name] = {**dataclasses.asdict(cost), "engine": dict(ENGINE), "fit": stats,
                    "command": " ".join(["benchmarks/sim_scheduler.py"] + sys.argv[1:]),
                    "recorded": time.strftime("%Y-%m-%d")}
    with open(COST_MODELS, "w") as f:
        json.dump(models, f, indent=2)
        f.write("\n")
    print(f"stored cost model {name!r} in {COST_MODELS}", flush=True)


def simulated_capacity(model_dir: str, traces: list[str], cost: StepCostModel, engine: dict) -> tuple[dict, dict]:
    """Per trace kind, the simulated saturation capacity (FCFS, every request at t=0; enough requests to fill every
    slot) in req/s, and that run's step-cost fit (the warm start of the token-weighted runs)."""
    cap, warm = {}, {}
    for kind in traces:
        mix = make_mix(kind, max(120, 3 * engine["max_num_seqs"]), 1000)
        run = simulate(model_dir, mix, [0.0] * len(mix), cost, token_weighted=False, **engine)
        cap[kind] = len(mix) / (run["t_end"] - run["t0"])
        warm[kind] = run["warm"]
    return cap, warm


def step_records(real: dict) -> list:
    """Every replay's per-step records of a results file (either format), runs kept apart (the gap between two runs
    is idle time, dropped by the fit)."""
    pooled_records = []
    for reps in real.get("per_step", {}).values():
        for rep in reps:
            for trace in rep.values():
                rec = trace["comp"]
                if rec:
                    pooled_records += rec + [[rec[-1][0] + 1e6, 0, 0, 0, 0, 0]]
    return pooled_records


def predict_paired(raw: dict, slo: float, invert: bool = False, config: tuple | None = None) -> dict:
    """The simulator's prediction for a paired ``bench_scheduler.py`` run (its ``.raw.json``): the step-cost model
    fitted to that run's own steps, the same traces (seeds, loads, the measured capacity's rates) through FCFS and
    the token-weighted scheduler (the run's settings, or ``config``: a :func:`parse_config` result), and the ratios
    computed the way the real ones are — per seed, traces pooled, then the geometric mean over seeds. ``invert``:
    report FCFS / token-weighted (when the run's side 1 is FCFS)."""
    from qwen_vllm_ext.demo import ensure_demo_model

    model_dir = str(ensure_demo_model(variant=raw["model"]))
    engine = {k: raw["engine"][k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
    cost, stats = fit_cost_model(step_records(raw))
    print(f"  step-cost fit to the run's own steps: {stats['steps']} steps, R^2 {stats['r2']:.3f}, median |error| "
          f"{100 * stats['median_rel_err']:.0f}%", flush=True)
    _, policy, auto = config or parse_config("real:" + ",".join(
        f"{k}={v}" for k, v in (raw.get("token_weighted_settings") or {}).items()))
    traces, n = raw["traces"], raw["requests_per_trace"]
    _, warm = simulated_capacity(model_dir, traces, cost, engine)
    cells: dict = {}
    for load in raw["loads"]:
        per_seed = []
        for seed in raw["seeds"]:
            runs = {}
            for tw in (False, True):
                runs[tw] = [simulate(model_dir, make_mix(kind, n, seed),
                                     make_arrivals(kind, n, load * raw["capacity"][kind]["req_s"], seed), cost,
                                     token_weighted=tw, policy=policy if tw else None, warm=warm.get(kind) if tw else None,
                                     auto=auto and tw, **engine) for kind in traces]
            f, t = (summarize(pooled(runs[x]), slo) for x in (False, True))
            per_seed.append({m: (ratio(f[m], t[m]) if invert else ratio(t[m], f[m])) for m, *_ in METRICS})
            per_seed[-1]["absolute"] = {"fcfs": {m: f[m] for m, *_ in METRICS}, "tw": {m: t[m] for m, *_ in METRICS}}
        cells[str(load)] = {m: math.exp(sum(math.log(p[m]) for p in per_seed) / len(per_seed))
                            for m, *_ in METRICS}
        cells[str(load)]["per_seed"] = per_seed
        # The simulated seconds themselves (mean over seeds), next to the real ones: the fit's fidelity.
        cells[str(load)]["absolute"] = {side: {m: sum(p["absolute"][side][m] for p in per_seed) / len(per_seed)
                                               for m, *_ in METRICS} for side in ("fcfs", "tw")}
        print(f"  simulator, {load}x: " + "  ".join(f"{label} {cells[str(load)][m]:.3f}" for m, label, *_ in METRICS),
              flush=True)
    return {"cells": cells, "cost_model": dataclasses.asdict(cost), "fit": stats}


def fit_and_check(args, model_dir: str, traces: list[str]):
    """The cost model fitted to a real run's steps, and the fidelity checks against that run."""
    with open(args.fit) as f:
        real = json.load(f)
    if real.get("paired"):  # a paired run's .raw.json: the fit and the prediction for its own traces
        print(f"\nprediction for the paired run {args.fit} (its traces at its rates, its own step-cost fit):")
        prediction = predict_paired(real, args.slo, invert=real["sides"][0] in ("tw", "auto"))
        cost = StepCostModel(**prediction["cost_model"])
        for config in (parse_config(c) for c in args.config):  # other settings on the same traces (a frontier)
            print(f"\nthe same traces with --config {config[0]}:", flush=True)
            prediction.setdefault("configs", {})[config[0]] = {
                "settings": {**vars(config[1]), "mode": "auto" if config[2] else "true"},
                **predict_paired(real, args.slo, invert=real["sides"][0] in ("tw", "auto"), config=config)}
        return cost, prediction["fit"], prediction, None
    if not any(rep for reps in real.get("per_step", {}).values() for rep in reps):
        raise SystemExit(f"{args.fit} has no per-step records (run bench_scheduler.py from this version)")
    cost, stats = fit_cost_model(step_records(real))
    print(f"cost model (s/step) = {cost.base * 1e3:.2f} ms + {cost.per_request * 1e3:.3f} ms/request + "
          f"{cost.per_token * 1e3:.4f} ms/token + {cost.per_ctx * 1e9:.3f} ns/(token x context)"
          + (f" + {cost.per_decode_ctx * 1e9:.2f} ns/decode-context token" if stats["decode_ctx_term"] else
             " (no decode-context term: the results file predates it)") + "; fitted on "
          f"{stats['steps']} steps, R^2 {stats['r2']:.3f}, median |error| {100 * stats['median_rel_err']:.0f}%", flush=True)

    # Fidelity: the real run's traces at its rates, simulated, next to its measured figures.
    real_cap = {k: v["req_s"] for k, v in real["capacity"].items()}
    real_n = real["requests_per_trace"]
    print(f"\nfidelity (real run's traces at its rates; real TW settings {real.get('token_weighted_settings') or 'defaults'}):")
    _, real_policy, real_auto = parse_config("real:" + ",".join(
        f"{k}={v}" for k, v in (real.get("token_weighted_settings") or {}).items()))
    fidelity = {}
    for load in real["loads"]:
        rates = {k: load * real_cap[k] for k in traces}
        for policy in ("fcfs", "tw"):
            sim_runs = run_traces(model_dir, traces, real_n, rates, cost, real["args"]["seed"], policy == "tw",
                                  real_policy if policy == "tw" else None, real_auto and policy == "tw")
            s = summaries(sim_runs, traces, args.slo)["all"]
            r = real["summary"][str(load)]["all"][policy]
            fidelity[f"{load}-{policy}"] = {"sim": s, "real": {m: r[m] for m, *_ in METRICS}}
            print(f"  {load}x {policy:>4}: " + "  ".join(
                f"{label} sim {s[m]:.2f} / real {r[m]:.2f}" for m, label, *_ in METRICS), flush=True)

    engine_time = engine_time_check(real)
    return cost, stats, fidelity, engine_time


def sweep(args, model_dir: str, traces: list[str], loads: list[float], seeds: list[int], configs: list, cost,
          cap: dict, speed: float, table: dict) -> None:
    """Each configuration against FCFS at each seed and load; rows go into ``table[name]["speed-seed-load"]``."""
    tag = "" if speed == 1 else f"speed {speed:g} "
    for seed in seeds:
        for load in loads:
            rates = {k: load * cap[k] for k in traces}
            base = summaries(run_traces(model_dir, traces, args.requests, rates, cost, seed, False, None), traces, args.slo)
            for name, cfg, auto in configs:
                runs = run_traces(model_dir, traces, args.requests, rates, cost, seed, True, cfg, auto)
                tw = summaries(runs, traces, args.slo)
                row = {}
                for scope in traces + ["all"]:
                    row[scope] = {m: ratio(tw[scope][m], base[scope][m]) for m, *_ in METRICS}
                row["fcfs"] = {m: base["all"][m] for m, *_ in METRICS}
                row["tw"] = {m: tw["all"][m] for m, *_ in METRICS}
                if auto:  # the share of steps the gate let the policy order
                    gates = [runs[k]["gate"] for k in traces]
                    row["gate"] = {"overloaded_steps": sum(g["overloaded_steps"] for g in gates),
                                   "steps": sum(g["steps"] for g in gates), "switches": sum(g["switches"] for g in gates)}
                ok = all((row["all"][m] <= lim) if op == "<=" else (row["all"][m] >= lim)
                         for m, _, op, lim in METRICS if lim is not None)
                table.setdefault(name, {})[f"{speed:g}-{seed}-{load}"] = row
                print(f"{tag}seed {seed} {load}x {name:>14}: pooled " + "  ".join(
                    f"{label} {row['all'][m]:.2f}" for m, label, *_ in METRICS)
                    + f"  | FCFS mean {base['all']['ttft_mean_s']:.3f} s p99 {base['all']['ttft_p99_s']:.3f} s"
                    + ("  PASS" if ok else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
