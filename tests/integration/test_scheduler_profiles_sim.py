"""Issue #35: the defaults re-checked, not read back. For every shipped profile with a step-cost model, a fresh
simulator pass (``benchmarks/sim_scheduler.py``: vLLM's real schedulers on a virtual clock, that hardware's cost model
and that profile's batch limits, the shipped policy always on and behind the overload gate (``auto``), trace seed 0
at 0.8x, 1.2x and 1.7x of capacity) must

* reproduce the committed results the docs cite (``docs/results/scheduler-sim/auto-<profile>.json``, seed 0) — the
  simulator is deterministic, so a change in vLLM's scheduler, the policy or the traces shows up here;
* meet every never-worse target (mean TTFT <= 1.0x, p99 <= 1.05x, throughput >= 0.98x FCFS): the docs' reason to try
  the token-weighted scheduler on that hardware, and the least a profile shipping it on needs (it also needs a real
  engine's comparison: tests/unit/test_hardware_profiles.py)."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.profiles import load_profile, profile_names

from ..helpers.scripts import run_script_runs

ROOT = Path(__file__).resolve().parents[2]
COST_MODELS = json.loads((ROOT / "benchmarks" / "cost_models.json").read_text())
SIMULATED = [name for name in profile_names() if name in COST_MODELS]
LOADS = ("0.8", "1.2", "1.7")


def test_every_gpu_profile_has_a_cost_model():
    gpu = [n for n in profile_names() if load_profile(n).device == "cuda"]
    assert gpu and set(gpu) <= set(SIMULATED), (gpu, SIMULATED)


@pytest.fixture(scope="module")
def fresh_passes(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each profile's simulator pass, ``python benchmarks/sim_scheduler.py ... --out WORK/<profile>.json`` run once per
    profile in one process (vLLM's scheduler imported once)."""
    work = tmp_path_factory.mktemp("sim")
    argvs = [["--cost-model", name, "--loads", ",".join(LOADS), "--seeds", "0", "--config", "shipped:", "--config",
              "auto:mode=auto", "--out", str(work / f"{name}.json")] for name in SIMULATED]
    procs = run_script_runs(ROOT / "benchmarks" / "sim_scheduler.py", argvs, work, cwd=ROOT)
    return {name: (proc, work / f"{name}.json") for name, proc in zip(SIMULATED, procs)}


@pytest.mark.parametrize("name", SIMULATED)
def test_a_fresh_simulator_pass_reproduces_the_docs_and_backs_the_profile(name, fresh_passes):
    proc, out = fresh_passes[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(out.read_text())
    committed = json.loads((ROOT / "docs" / "results" / "scheduler-sim" / f"auto-{name}.json").read_text())
    for config in ("shipped", "auto"):
        assert fresh["configs"][config] == committed["configs"][config]
        for load in LOADS:
            now = fresh["ratios"][config][f"1-0-{load}"]["all"]
            then = committed["ratios"][config][f"1-0-{load}"]["all"]
            assert set(now) == set(then)
            for metric, value in now.items():
                assert math.isclose(value, then[metric], rel_tol=1e-6, abs_tol=1e-9), (config, load, metric, value,
                                                                                       then[metric])
    # The docs' reason to try it on this hardware (docs/scheduling.md): never worse in the simulator at every load.
    # Off by default all the same (no real engine could show it; issue #35) — but a profile that ships it on must at
    # least pass here.
    verdicts = {load: fresh["medians"]["shipped"][f"1-{load}"]["never_worse"] for load in LOADS}
    mode = Settings.resolve(env={}, base=load_profile(name).extension).token_weighted_scheduler
    assert all(verdicts.values()), (f"{name}: the simulator no longer finds the shipped policy never worse "
                                    f"({verdicts}; profile default {mode})")
