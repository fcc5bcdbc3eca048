"""benchmarks/sim_scheduler.py end to end on a small trace: a stored CPU cost model and a GPU one, the shipped policy
against FCFS, the results JSON with per-seed ratios and the median table (the script is never an untested stub)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.scripts import run_script_runs

ROOT = Path(__file__).resolve().parents[2]


COST_MODELS = ("cpu-demo", "h100-80gb")


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """``python benchmarks/sim_scheduler.py --cost-model M ...`` per cost model, run in one process (vLLM's scheduler
    imported once)."""
    work = tmp_path_factory.mktemp("sim")
    argvs = [["--cost-model", m, "--requests", "60", "--loads", "1.2", "--seeds", "0", "--config", "shipped:",
              "--config", "previous:measured_costs=false,max_slip=0", "--config", "auto:mode=auto",
              "--out", str(work / f"{m}.json")] for m in COST_MODELS]
    procs = run_script_runs(ROOT / "benchmarks" / "sim_scheduler.py", argvs, work, cwd=ROOT, timeout=600)
    return {m: (proc, work / f"{m}.json") for m, proc in zip(COST_MODELS, procs)}


@pytest.mark.parametrize("cost_model", COST_MODELS)
def test_sim_scheduler_runs_a_stored_cost_model(small_runs, cost_model):
    proc, out = small_runs[cost_model]
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["ratios"]) == {"shipped", "previous", "auto"}
    assert result["configs"]["previous"]["measured_costs"] is False and result["configs"]["shipped"]["max_slip"] == 0.10
    assert result["configs"]["auto"]["mode"] == "auto" and result["configs"]["shipped"]["mode"] == "true"
    gate = result["ratios"]["auto"]["1-0-1.2"]["gate"]  # behind the gate: the share of steps it let the policy order
    assert 0 <= gate["overloaded_steps"] <= gate["steps"] and "gate" not in result["ratios"]["shipped"]["1-0-1.2"]
    cell = result["intervals"]["auto"]["1-1.2"]
    assert isinstance(cell["targets_met"], bool) and cell["longtail"]["ttft_mean_s"]["n"] == 1
    row = result["ratios"]["shipped"]["1-0-1.2"]["all"]
    assert all(math.isfinite(v) and v > 0 for v in row.values())
    assert result["medians"]["shipped"]["1-1.2"]["seeds"] == 1
    assert "median over seeds" in proc.stdout
    engine = result["engine"]
    assert engine["max_num_seqs"] == (32 if cost_model.startswith("cpu") else 256)


def test_sim_scheduler_refuses_unknown_cost_models_and_settings(tmp_path):
    for args, message in ((["--cost-model", "tpu-v9"], "known:"),
                          (["--cost-model", "cpu-demo", "--config", "x:no_such=1"], "unknown setting"),
                          (["--cost-model", "cpu-demo", "--config", "x:measured_costs=maybe"], "expects true/false")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_scheduler.py"), *args,
                               "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout


def test_a_config_with_an_unknown_mode_is_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_scheduler.py"), "--cost-model", "cpu-demo",
                           "--config", "x:mode=sometimes"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "mode must be true or auto" in proc.stderr
