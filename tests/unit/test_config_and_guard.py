"""Settings precedence and the vLLM version guard (pure Python)."""
import json

import pytest

from qwen_vllm_ext.integration.vllm_version import unsupported_message, version_supported
from qwen_vllm_ext.config import RESOLVED_ENV, Settings, SettingsError
from qwen_vllm_ext.plugin import patch_decision


def test_defaults_serve_most_users(monkeypatch):
    monkeypatch.setenv("QWEN_VLLM_EXT_HOME", "/srv/qve")
    s = Settings.resolve(env={})
    assert s.enabled is True and s.allow_unsupported_vllm is False
    assert s.data_dir == "/srv/qve/data"


def test_precedence_defaults_profile_env_additional_config_cli():
    base = {"data_dir": "/profile"}
    assert Settings.resolve(env={}, base=base).data_dir == "/profile"
    env = {"QWEN_VLLM_EXT_DATA_DIR": "/env", "QWEN_VLLM_EXT_ENABLED": "off"}
    assert Settings.resolve(env=env, base=base).data_dir == "/env"
    extra = {"qwen_vllm_ext": {"data_dir": "/extra"}, "other_plugin": {"x": 1}}
    s = Settings.resolve(env=env, additional_config=extra, base=base)
    assert s.data_dir == "/extra" and s.enabled is False
    s = Settings.resolve(env=env, additional_config=extra, cli={"data_dir": "/cli", "enabled": None}, base=base)
    assert s.data_dir == "/cli" and s.enabled is False  # None = flag not given


def test_bad_settings_are_named():
    with pytest.raises(SettingsError, match="unknown setting 'bogus'; known settings: enabled, data_dir"):
        Settings.resolve(env={}, cli={"bogus": 1})
    with pytest.raises(SettingsError, match="'enabled' expects true/false, got 'maybe'"):
        Settings.resolve(env={"QWEN_VLLM_EXT_ENABLED": "maybe"})
    with pytest.raises(SettingsError, match="must be a JSON object"):
        Settings.resolve(env={}, additional_config={"qwen_vllm_ext": "on"})


def test_export_reaches_child_processes(monkeypatch):
    monkeypatch.delenv(RESOLVED_ENV, raising=False)
    monkeypatch.setenv("QWEN_VLLM_EXT_DATA_DIR", "/from-env")
    s = Settings.resolve(env={}, cli={"data_dir": "/resolved", "allow_unsupported_vllm": True})
    environ = {}
    s.export(environ)
    assert json.loads(environ[RESOLVED_ENV])["data_dir"] == "/resolved"
    monkeypatch.setenv(RESOLVED_ENV, environ[RESOLVED_ENV])
    assert Settings.current() == s  # the resolved blob wins over loose env vars


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.1+cpu", True), ("0.33.0rc1", True), ("0.31.9", False), ("0.34.0", False),
    ("1.0.0", False), ("dev", False),
])
def test_version_guard(version, ok):
    assert version_supported(version) is ok


def test_patch_decision_refuses_unknown_vllm_unless_overridden():
    allowed, reason = patch_decision(Settings(), "0.34.0")
    assert not allowed and reason == unsupported_message("0.34.0")
    assert "supported: 0.32.x, 0.33.x" in reason and "QWEN_VLLM_EXT_ALLOW_UNSUPPORTED_VLLM=1" in reason
    allowed, reason = patch_decision(Settings(allow_unsupported_vllm=True), "0.34.0")
    assert allowed and "patching anyway" in reason
    assert patch_decision(Settings(), "0.32.0") == (True, "vLLM 0.32.0 is supported")
    assert patch_decision(Settings(enabled=False), "0.32.0")[0] is False


def test_readme_documents_every_setting():  # the settings reference moved to docs/settings.md
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    for name in Settings.field_names():
        assert f"| `{name}` |" in reference, (f"setting {name} missing from docs/settings.md: run "
                                              f".venv/bin/python scripts/gen_settings_doc.py")


def test_public_settings_hide_secrets():
    s = Settings(admin_key="topsecret-admin", gateway_secret="s" * 20, spike_webhook="https://hook/tok",
                 ledger_redis_url="redis://user:pw123@10.0.0.5:6379/0")
    public = json.dumps(s.public())
    for secret in ("topsecret-admin", "s" * 20, "https://hook/tok", "pw123"):
        assert secret not in public
    assert s.public()["admin_key"] == "***" and s.public()["ledger_redis_url"] == "redis://user:***@10.0.0.5:6379/0"
    assert Settings().public()["admin_key"] == ""  # unset stays visibly unset


def test_settings_are_resolved_once_per_process_and_bill_through_one_object(monkeypatch):
    """Issue 52: Settings.current() returns the same object while the QWEN_VLLM_EXT_* environment is unchanged (the
    plugin, the hooks and the health route no longer re-parse it), a change is seen, and the billing object (policy +
    prices) is built once per settings object."""
    from qwen_v3_calculator.billing import Billing

    monkeypatch.delenv("QWEN_VLLM_EXT_SETTINGS", raising=False)
    monkeypatch.setenv("QWEN_VLLM_EXT_PRICE_PROMPT", "1")
    first = Settings.current()
    assert Settings.current() is first
    assert isinstance(first.billing, Billing) and first.billing is first.billing
    assert first.billing.prices == first.prices() and first.billing.policy.name == first.billing_policy
    assert first.billing.cost_pico(1000, 0) == 10**9  # 1 USD per million prompt tokens: 1,000 cost a thousandth
    monkeypatch.setenv("QWEN_VLLM_EXT_PRICE_PROMPT", "2")
    second = Settings.current()
    assert second is not first and second.billing.cost_pico(1000, 0) == 2 * 10**9
