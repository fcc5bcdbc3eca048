"""Issue 45: nothing a client sends is stored, labelled or logged unchecked, and no field makes admission fail with
anything but a 4xx. Pure parts: client-string checks, body parsing, admission bounds, key validation, the ledger
record's model label, the unauthenticated-record cap, bounded metric labels; plus a fuzz of admission over every
field of the request-field table with hostile values."""
from __future__ import annotations

import dataclasses
import json

import pytest

from qwen_v3_calculator import Calculator
from qwen_vllm_ext.common.client_strings import (BadClientString, check_label, find_lone_surrogate,
                                                 may_hold_surrogates, printable, problem, storable)
from qwen_vllm_ext.gateway.admission import Rejection, Served, admit, parse_body
from qwen_vllm_ext.gateway.request_fields import CHAT_FIELDS, COMPLETION_FIELDS
from qwen_vllm_ext.keys import ApiKey, validate_fields
from qwen_vllm_ext.usage.metrics import model_label
from qwen_vllm_ext.usage.middleware import PerSecondCap, record_model

from ..hostile import VALUES, encode, field_cases

HI = [{"role": "user", "content": "hi"}]


@dataclasses.dataclass
class Key:
    models: tuple = ()
    max_tokens_cap: int | None = None
    max_n: int | None = None

    def allows_model(self, name):
        return not self.models or name in self.models


@pytest.fixture(scope="module")
def served():
    return Served(Calculator(template="qwen3"), 4096, names=("qwen3-demo",),
                  engine_fields={"chat": frozenset(CHAT_FIELDS), "completion": frozenset(COMPLETION_FIELDS)})


def rejection(fn, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as exc:
        fn(*args, **kwargs)
    return exc.value


# ---- client strings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,ok", [("qwen3-demo", True), ("", True), ("é中文", True), ("\ud800", False),
                                      ("a\x00b", False), ("\x1b[31m", False), ("\u0085", False), ("x" * 257, False),
                                      ("x" * 256, True)])
def test_a_label_is_storable_only_without_surrogates_controls_or_excess_length(value, ok):
    assert (problem(value, 256) is None) is ok
    assert (storable(value, 256) == value) is ok
    if not ok:
        with pytest.raises(BadClientString) as exc:
            check_label("model", value, 256)
        assert exc.value.field == "model" and "'model'" in str(exc.value)


def test_free_text_keeps_newlines_but_not_surrogates_or_nul():
    assert problem("line\nnext\ttab", 100, allow_controls=True) is None
    assert "surrogate" in problem("a\udc00", 100, allow_controls=True)
    assert "U+0000" in problem("a\x00", 100, allow_controls=True)


def test_lone_surrogates_are_found_by_path_and_pairs_are_not_lone():
    pair = encode({"messages": [{"content": "\U0001F600"}]})  # escaped as \ud83d\ude00: a valid pair
    assert may_hold_surrogates(pair) and find_lone_surrogate(json.loads(pair)) is None
    assert not may_hold_surrogates(b'{"model": "qwen3-demo"}')
    body = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": ["x", "\ud800"]}]}
    assert find_lone_surrogate(body) == "messages[1].content[1]"
    assert find_lone_surrogate({"a": {"\udfff": 1}}) == "a (a key)"


def test_printable_escapes_terminal_controls_and_surrogates():
    assert printable("\x1b[31mred\x1b[0m") == "\\x1b[31mred\\x1b[0m"
    assert printable("a\ud800b") == "a\\ud800b"
    assert printable("日本語 ok") == "日本語 ok"


# ---- the gateway's body checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"model": "\ud800", "messages": HI}, "model"),
    ({"model": "m" * (4 << 20), "messages": HI}, "model"),
    ({"model": "\x1b[2J", "messages": HI}, "model"),
    ({"model": "qwen3-demo", "user": "u\x00", "messages": HI}, "user"),
    ({"model": "qwen3-demo", "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ({"model": "qwen3-demo", "messages": HI, "stop": ["\udc00"]}, "stop[0]"),
])
def test_a_body_with_an_unstorable_string_is_refused_naming_the_field(body, param):
    rej = rejection(parse_body, encode(body))
    assert (rej.status, rej.code, rej.param) == (400, "invalid_value", param)


def test_the_string_check_runs_before_the_key_scope(served):
    """The probe's case: a key scoped to another model sent model "\\ud800" and got 403 with its record stored."""
    raw = encode({"model": "\ud800", "messages": HI})
    assert rejection(parse_body, raw).status == 400
    body = parse_body(encode({"model": "qwen3-demo", "messages": [{"role": "user", "content": "smile \U0001F600"}]}))
    assert admit(body, "chat", Key(), served).prompt_tokens > 0  # an escaped emoji (a surrogate pair) is fine


@pytest.mark.parametrize("n", [10**30, 2**31, -1, 0, 1.5, "2", True])
def test_n_out_of_range_is_a_400_never_decimal_arithmetic(served, n):
    rej = rejection(admit, {"model": "qwen3-demo", "messages": HI, "n": n, "max_tokens": 1}, "chat", Key(), served)
    assert (rej.status, rej.param) == (400, "n")
    assert len(rej.message) < 300  # no 31-digit echo of a huge number


def test_n_is_capped_by_the_server_and_by_the_key(served):
    body = lambda n: {"model": "qwen3-demo", "messages": HI, "n": n, "max_tokens": 1}  # noqa: E731
    assert admit(body(128), "chat", Key(), served, max_n=128).completion_tokens == 128
    rej = rejection(admit, body(129), "chat", Key(), served, max_n=128)
    assert rej.param == "n" and "max_n" in rej.message
    rej = rejection(admit, body(5), "chat", Key(max_n=4), served, max_n=128)
    assert "this API key's max_n" in rej.message
    assert admit(body(16384), "chat", Key(), served, max_n=0).completion_tokens == 16384  # 0: no bound


def test_sequences_per_request_count_every_prompt_of_a_batch(served):
    body = {"model": "qwen3-demo", "prompt": ["a"] * 40, "n": 8, "max_tokens": 1}
    rej = rejection(admit, dict(body), "completion", Key(), served, max_sequences=256)
    assert (rej.status, rej.code) == (400, "too_many_sequences") and "320" in rej.message
    assert admit(dict(body, n=6), "completion", Key(), served, max_sequences=256).completion_tokens == 240


@pytest.mark.parametrize("field,value", [("max_tokens", 10**30), ("max_completion_tokens", 2**63),
                                         ("min_tokens", 10**30)])
def test_other_token_counts_are_bounded_before_any_arithmetic(served, field, value):
    rej = rejection(admit, {"model": "qwen3-demo", "messages": HI, field: value}, "chat", Key(), served)
    assert (rej.status, rej.param) == (400, field)


@pytest.mark.parametrize("kind,base", [
    ("chat", {"model": "qwen3-demo", "messages": HI, "max_tokens": 4}),
    ("completion", {"model": "qwen3-demo", "prompt": "hi", "max_tokens": 4}),
])
def test_fuzz_every_request_field_admits_or_refuses_with_a_4xx(served, kind, base):
    """Every field of the request-field table set to every hostile value: admission either admits (with a cost that
    is a plain bounded integer) or refuses with a 4xx naming a reason -- never another exception."""
    seen = 0
    for field, value, body in field_cases(kind, base):
        try:
            body = parse_body(encode(body))
            result = admit(body, kind, Key(max_tokens_cap=64), served, max_n=128, max_sequences=256)
        except Rejection as rej:
            assert 400 <= rej.status < 500 and rej.code and rej.message, (field, value)
        else:
            assert isinstance(result.cost, int) and 0 < result.cost <= 4096 * 256, (field, value)
            result.encoded().decode("utf-8")  # what is forwarded to vLLM is valid UTF-8
        seen += 1
    assert seen == len(VALUES) * len(FIELDS_OF[kind])


FIELDS_OF = {"chat": CHAT_FIELDS, "completion": COMPLETION_FIELDS}


# ---- key fields ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [{"name": "\ud800"}, {"name": "evil\x1b[2J"}, {"models": ["\ud800"]},
                                    {"labels": {"team": "\x00"}}, {"suspend_reason": "\udc80"},
                                    {"models": ["m" * 300]}, {"max_n": 0}, {"max_n": 10**30}])
def test_key_fields_that_cannot_be_stored_or_printed_are_refused(fields):
    with pytest.raises(ValueError) as exc:
        validate_fields(fields)
    assert next(iter(fields)) in str(exc.value)
    str(exc.value).encode("utf-8")  # the error itself can be sent as JSON


def test_the_cli_escapes_control_characters_of_stored_keys():
    from qwen_vllm_ext.keys.__main__ import format_list, format_show

    key = ApiKey(key_id="k_1", name="evil\x1b[2Jname", prefix="qve-abc", created_at=0.0, models=["m\x07"])
    for text in (format_list([key]), format_show(key)):
        assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text


# ---- what records and metrics carry -------------------------------------------------------------------------------
SERVED = ("qwen3-demo", "alias")


@pytest.mark.parametrize("client,resolved,ran,expected", [
    ("qwen3-demo", "qwen3-demo", True, "qwen3-demo"),
    ("alias", None, False, "alias"),  # refused, but a served name
    ("some-other-model", None, False, ""),  # refused (scope, 404): no client label
    ("\ud800", None, False, ""),
    ("m" * 5000, "m" * 5000, False, ""),
    (None, None, False, "qwen3-demo"),  # named no model: the default one
    ("", "qwen3-demo", True, "qwen3-demo"),
    ("my-lora", "my-lora", True, "my-lora"),  # vLLM ran it: a name it accepted (a LoRA adapter)
    ("\ud800", "\ud800", True, ""),  # never unstorable
])
def test_a_record_carries_a_served_model_never_a_refused_client_string(client, resolved, ran, expected):
    assert record_model(client, resolved, SERVED, ran) == expected


def test_ten_thousand_client_models_make_one_other_series():
    labels = {model_label(f"model-{i}", SERVED) for i in range(10_000)} | {model_label(m, SERVED) for m in SERVED}
    assert labels == {"qwen3-demo", "alias", "other"}


def test_unauthenticated_records_are_capped_per_second():
    now = [0.0]
    cap = PerSecondCap(2.0, clock=lambda: now[0])
    assert [cap.allow() for _ in range(5)] == [True, True, False, False, False]
    now[0] += 0.5
    assert [cap.allow() for _ in range(3)] == [True, False, False]
    now[0] += 100
    assert sum(cap.allow() for _ in range(10)) == 2  # the bucket holds one second's worth, not a backlog
    assert not PerSecondCap(0).allow()


@pytest.mark.parametrize("value,path", [
    ({"n": 10**30}, "n"), ({"stream_interval": -(2**63)}, "stream_interval"), ({"temperature": float("nan")}, "temperature"),
    ({"logit_bias": {"1": float("inf")}}, "logit_bias.1"), ({"prompt": [[1, 2**64]]}, "prompt[0][1]"),
])
def test_numbers_beyond_int64_or_not_finite_are_refused_anywhere_in_the_body(value, path):
    rej = rejection(parse_body, encode({"model": "qwen3-demo", "messages": HI, **value}))
    assert (rej.status, rej.code, rej.param) == (400, "invalid_value", path)
    assert len(rej.message) < 200
    assert parse_body(encode({"model": "qwen3-demo", "seed": 2**63 - 1, "temperature": 0.7}))["seed"] == 2**63 - 1


# ---- what the public health route shows ---------------------------------------------------------------------------
def test_the_health_details_are_the_admins_when_the_gateway_is_on():
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.integration.plugin import details_allowed, public_view

    report = {"extension": "qwen_vllm_ext", "instance_id": "host-abc", "processes": [{"pid": 12, "role": "api_server"}],
              "launch": {"profile": "cpu"}, "scheduler": [{"pid": 13, "scheduler": "TokenWeighted", "stats": {"a": 1}}],
              "ledger": {"ready": True, "spill_dir": "/srv/data", "queue_depth": 0},
              "settings": {"gateway": True, "data_dir": "/srv/data", "admin_key": "***", "max_n": 128}}
    view = public_view(report)
    assert view["settings"] == {"gateway": True} and "details" in view
    assert not {"instance_id", "processes", "launch"} & set(view)
    assert view["scheduler"] == [{"scheduler": "TokenWeighted", "stats": {"a": 1}}]
    assert view["ledger"] == {"ready": True, "queue_depth": 0}
    assert "/srv/data" not in json.dumps(view) and "host-abc" not in json.dumps(view)

    on = Settings(gateway=True, admin_key="admin-0123456789")
    scope = lambda token: {"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]}  # noqa: E731
    assert details_allowed(scope("admin-0123456789"), on)
    assert not details_allowed(scope("wrong"), on) and not details_allowed({"headers": []}, on)
    assert not details_allowed(scope(""), Settings(gateway=True))  # no admin key set: nobody sees the details
    assert details_allowed({"headers": []}, Settings(gateway=False))  # nothing asks for keys with the gateway off


# ---- websockets ---------------------------------------------------------------------------------------------------
def test_a_websocket_needs_a_key_like_http(tmp_path):
    """A realtime (websocket) route behind the gateway: no key or a wrong one -> the handshake is closed with 1008 and
    the app never runs; a valid key reaches it with its key id on the request context (real SQLite key store)."""
    import asyncio

    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.gateway.middleware import GatewayMiddleware
    from qwen_vllm_ext.keys import KeyCache, SqliteKeyStore

    keys = SqliteKeyStore(str(tmp_path / "ledger.sqlite3"), "s" * 32)
    secret, key = keys.create("ws")
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["state"]["qwen_vllm_ext"].api_key_id)
        await send({"type": "websocket.accept"})

    gw = GatewayMiddleware(app, settings=Settings(data_dir=str(tmp_path), gateway=True), keys=KeyCache(keys),
                           limiter=None, policy=None)

    def connect(headers):
        sent = []

        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            sent.append(message)

        asyncio.run(gw({"type": "websocket", "path": "/v1/realtime", "headers": headers, "state": {}}, receive, send))
        return sent

    for headers in ([], [(b"authorization", b"Bearer qve-" + b"x" * 43)]):
        assert connect(headers) == [{"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"}]
    assert reached == []
    assert connect([(b"authorization", f"Bearer {secret}".encode())]) == [{"type": "websocket.accept"}]
    assert reached == [key.key_id]
