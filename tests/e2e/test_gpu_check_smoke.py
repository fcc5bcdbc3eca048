"""E2E: benchmarks/gpu_check.py --cpu-smoke — the prepared GPU check runs end to end on this CPU (the demo
architecture served from a config with --load-format dummy, as the GPU run serves Qwen3-8B's), so the script is never
an untested stub: stock vLLM vs the profile on one seeded workload with per-chunk usage and ledger checks, the
token-weighted scheduler against FCFS at 1.2x the measured capacity, one JSON and one PNG; the GPU-only phases say so."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_in_cpu_smoke_mode(tmp_path):
    out = tmp_path / "gpu_check_smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu-smoke" and result["pass"] is True
    names = {c["name"]: c["ok"] for c in result["checks"]}
    assert names == {"stock run completed": True,
                     "profile run: usage on every chunk and every ledger record match": True,
                     "the token-weighted class runs in the engine core": True}, names
    phases = result["phases"]
    one = phases["stock_vs_profile"]
    assert one["stock"]["completed"] == one["stock"]["requests"] == one["profile"]["requests"]
    assert all(one["ratios"][k] is not None for k in ("ttft_mean", "tpot_mean", "output_token_throughput"))
    two = phases["scheduler"]
    assert two["capacity_req_s"] > 0 and abs(two["rate_req_s"] - 1.2 * two["capacity_req_s"]) < 0.01
    assert two["engine_scheduler"] == "TokenWeightedScheduler"
    assert two["fcfs"]["requests"] == two["token_weighted"]["requests"] > 0
    assert phases["kv_offloading"] == phases["idle_sleep"] == "skipped: needs a GPU"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
