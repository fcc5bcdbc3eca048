"""deploy/prometheus: the rule file passes `promtool check rules`, every alert's unit tests (a series that fires it
and one that does not) pass `promtool test rules`, and every metric a rule names is one the server exports (ours in
qwen_vllm_ext, vLLM's in its metrics loggers)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "qwen-vllm-ext.rules.yml"
TESTS = ROOT / "deploy" / "prometheus" / "tests" / "qwen-vllm-ext.test.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool missing: ./scripts/setup.sh installs Debian's prometheus package"
    return path


def test_promtool_checks_the_rules():
    run = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr


def test_promtool_unit_tests_pass_and_cover_every_alert_both_ways():
    run = subprocess.run([promtool(), "test", "rules", TESTS.name], capture_output=True, text=True, timeout=300,
                         cwd=TESTS.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    fires, silent = set(), set()
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts and alerts <= fires, f"alerts without a firing test: {sorted(alerts - fires)}"
    assert alerts <= silent, f"alerts without a silent test: {sorted(alerts - silent)}"


def _sources(pattern: str, root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob(pattern))


def test_every_metric_a_rule_names_is_exported():
    import vllm

    rules = yaml.safe_load(RULES.read_text())
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    names = set(re.findall(r"(?<![:\w])((?:vllm:|qwen_ext_)[A-Za-z0-9_:]+)", exprs))  # not recorded series
    ours = _sources("*.py", ROOT / "qwen_vllm_ext")
    theirs = _sources("*.py", Path(vllm.__file__).parent / "v1" / "metrics")
    missing = []
    for name in sorted(names):
        base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
        source = theirs if name.startswith("vllm:") else ours
        if f'"{base}"' not in source and f"'{base}'" not in source:
            missing.append(name)
    assert not missing, f"rules name metrics nobody exports: {missing}"
