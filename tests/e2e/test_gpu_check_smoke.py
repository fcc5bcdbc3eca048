"""E2E: benchmarks/gpu_check.py --cpu-smoke — the prepared GPU check runs end to end on this CPU (the demo
architecture served from a config with --load-format dummy, as the GPU run serves Qwen3-8B's), so the script is never
an untested stub: stock vLLM vs the profile on one seeded workload with per-chunk usage and ledger checks, the
scheduler comparison (FCFS "a" and "b" and the token-weighted scheduler in auto mode resident at once, the same seeded trace on
each, interleaved; A/A and A/B ratios with intervals), one JSON and one PNG; the GPU-only phases say so."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LATE_GB = 10  # the script runs up to three servers at once (tests/e2e/servers.py)


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
    assert two["capacity_req_s"] > 0 and two["loads"] == [1.2] and two["repeats"] == 2
    assert two["engine_scheduler"] == "TokenWeightedScheduler"
    runs = two["runs"]["1.2"]
    assert set(runs) == {"fcfs_a", "fcfs_b", "auto"}  # the CPU smoke runs the gated mode (the GPU check adds "true")
    # every side replayed the same requests, every repeat, all completed
    counts = {side: [r["requests"] for r in reps] for side, reps in runs.items()}
    assert len({tuple(c) for c in counts.values()}) == 1 and all(len(c) == 2 for c in counts.values()), counts
    assert all(r["completed"] == r["requests"] > 0 for reps in runs.values() for r in reps), {
        side: [(r["completed"], r["requests"], r["not_completed"]) for r in reps] for side, reps in runs.items()}
    # the A/A and A/B ratios with their intervals, and a verdict that names which of the three outcomes it is
    for label in ("aa", "auto"):
        cell = two["comparisons"]["1.2"][label]
        for metric in ("ttft_mean_s", "ttft_p99_s", "output_tok_s", "goodput_req_s"):
            iv = cell["metrics"][metric]
            assert iv["n"] == 2 and iv["lo"] <= iv["point"] <= iv["hi"], (label, metric, iv)
        assert isinstance(cell["pass"], bool)
    assert two["aa_pass"] == two["comparisons"]["1.2"]["aa"]["pass"]
    assert two["verdict"].startswith(("auto: never worse", "the A/A pair does not pass", "auto: worse than FCFS"))
    assert two["never_worse"] is None and isinstance(two["never_worse_auto"], bool)
    assert phases["kv_offloading"] == phases["idle_sleep"] == "skipped: needs a GPU"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
