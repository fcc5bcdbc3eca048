"""deploy/prometheus: the rule file passes `promtool check rules` and every alert's unit tests (a series that fires it
and one that does not) pass `promtool test rules`. That every metric a rule names is catalogued and exported:
tests/unit/test_observability.py; that each returns data from a real server: tests/integration/test_monitoring.py."""
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


def test_every_alert_has_a_row_in_the_operating_guide():
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    guide = (ROOT / "docs" / "operating.md").read_text()
    rows = set(re.findall(r"^\| (Qwen\w+) \|", guide, flags=re.M))
    assert alerts == rows, (sorted(alerts - rows), sorted(rows - alerts))
