"""Running ``python -m qwen_vllm_ext.doctor`` against a live server and reading its verdicts."""
import json
import subprocess
import sys


def doctor(server, *args) -> tuple[int, dict[str, dict]]:
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.doctor", "--url", server.base_url, "--json", *args],
                          capture_output=True, text=True, timeout=600)
    checks = json.loads(proc.stdout)
    return proc.returncode, {c["name"]: c for c in checks}


def not_passing(checks: dict[str, dict]) -> list[dict]:
    return [c for c in checks.values() if c["status"] != "PASS"]
