"""The doctor's verdicts on what a server answers (its checks against live servers: tests/e2e/test_doctor.py)."""
import httpx
import pytest

from qwen_vllm_ext.doctor import Doctor

ADMIN = "admin-secret"


def admin_check(anonymous: int, admin_key: str | None, with_key: int = 200) -> dict:
    """The doctor's "gateway: admin routes" check on a gateway server whose admin route answers ``anonymous``
    without a key and ``with_key`` with ``ADMIN``."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/qwen_ext/admin/keys"
        if request.headers.get("authorization") == f"Bearer {ADMIN}":
            return httpx.Response(with_key, json={"object": "list", "data": []})
        return httpx.Response(anonymous, json={"error": {"message": "..."}})

    doctor = Doctor("http://server", admin_key=admin_key)
    doctor.http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(answer))
    doctor.health = {"settings": {"gateway": True}}
    doctor.check_admin()
    (check,) = doctor.checks
    assert check.name == "gateway: admin routes"
    return {"status": check.status, "seen": check.seen, "fix": check.fix}


@pytest.mark.parametrize("anonymous, admin_key, with_key, status, words", [
    (401, None, 200, "PASS", "closed without the admin key"),
    (401, ADMIN, 200, "PASS", "200 with it"),
    (401, ADMIN, 401, "FAIL", "the given admin key got 401"),
    (200, None, 200, "FAIL", "without the admin key: 200"),  # open to anyone
    (404, None, 200, "PASS", "disabled (404: admin_key not set)"),  # admin_key empty: the routes are off
    (404, ADMIN, 200, "FAIL", "disabled (404), yet --admin-key was given"),
])
def test_admin_routes_verdicts(anonymous, admin_key, with_key, status, words):
    check = admin_check(anonymous, admin_key, with_key)
    assert check["status"] == status and words in check["seen"], check
    assert bool(check["fix"]) == (status != "PASS")


def test_no_admin_check_with_the_gateway_off():
    doctor = Doctor("http://server")
    doctor.health = {"settings": {"gateway": False}}
    doctor.check_admin()
    assert doctor.checks == []
