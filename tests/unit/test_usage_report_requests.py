"""``python -m qwen_vllm_ext.usage report --requests``: one row per request, newest first, with filters, on a real
SQLite ledger file and a real Redis server (no mocks)."""
from __future__ import annotations

import calendar
import csv
from decimal import Decimal
import io
import json
import os
import subprocess
import sys
import time

import pytest

from qwen_vllm_ext.usage import __main__ as cli
from qwen_vllm_ext.usage.ledger import PROBE_PREFIX, LedgerRecord, open_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = float(calendar.timegm((2025, 3, 1, 12, 0, 0)))
A, B = "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"
HEAD = ["request_id", "received_at", "key", "model", "status", "http_status", "latency_s", "prompt_tokens",
        "cached_tokens", "completion_tokens", "reasoning_tokens", "billed", "cost_usd"]


def rec(rid: str, finished: float, key: str | None = "k_alice", model: str = A, **kw) -> LedgerRecord:
    """A record whose numbers derive from its finish time (so every row differs)."""
    n = int(finished - T0)
    prompt, cached, completion = 100 + n, n % 50, 10 + n % 7
    data = dict(request_id=rid, instance_id="inst-1", model=model, endpoint="/v1/chat/completions", status="stop",
                http_status=200, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                reasoning_tokens=n % 5, engine_prompt_tokens=prompt,
                billed_prompt_micro=(prompt - cached) * 1_000_000 + cached * 100_000,
                billed_completion_micro=completion * 1_350_000, received_at=finished - 1.5, finished_at=finished,
                ttft_s=0.2, latency_s=1.5, streamed=True, api_key_id=key,
                cost_pico_usd=(prompt - cached) * 150_000 + cached * 75_000 + completion * 600_000)
    data.update(kw)
    return LedgerRecord(**data)


# Newest first: (finished_at, request_id) descending; r-e and r-f finish at the same instant.
RECORDS = [
    rec("r-a", T0 + 10),
    rec("r-b", T0 + 20, key="k_bob"),
    rec("r-c", T0 + 30, model=B, http_status=499, status="client_disconnected"),
    rec("r-d", T0 + 40, key=None),
    rec("r-e", T0 + 50, key="k_bob", model=B),
    rec("r-f", T0 + 50),
    rec("r-g", T0 + 3600, status="length"),
    rec(PROBE_PREFIX + "1", T0 + 45, key=None),
]
NEWEST_FIRST = ["r-g", "r-f", "r-e", "r-d", "r-c", "r-b", "r-a"]
BY_ID = {r.request_id: r for r in RECORDS}


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{round(ts % 1 * 1000):03d}Z"


def billed(micro: int) -> str:
    return f"{micro // 10**6}.{micro % 10**6:06d}"


def usd(pico: int) -> str:
    return str(round(Decimal(pico) / 10**12, 6))


def json_row(r: LedgerRecord) -> dict:
    return {"request_id": r.request_id, "received_at": iso(r.received_at), "key": r.api_key_id or "",
            "model": r.model, "status": r.status, "http_status": r.http_status, "latency_s": r.latency_s,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens, "reasoning_tokens": r.reasoning_tokens,
            "billed_micro": r.billed_prompt_micro + r.billed_completion_micro, "cost_pico_usd": r.cost_pico_usd}


def table_cells(r: LedgerRecord) -> list[str]:
    return [r.request_id, iso(r.received_at), r.api_key_id or "-", r.model, r.status, str(r.http_status),
            f"{r.latency_s:.3f}", *(str(getattr(r, f)) for f in ("prompt_tokens", "cached_tokens",
                                                                   "completion_tokens", "reasoning_tokens")),
            billed(r.billed_prompt_micro + r.billed_completion_micro), usd(r.cost_pico_usd)]


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(params=["sqlite", "redis"])
def where(request, tmp_path) -> list[str]:
    """The CLI flags naming a fresh, empty ledger of each backend."""
    if request.param == "sqlite":
        return ["--db", str(tmp_path / "ledger.sqlite3")]
    server = request.getfixturevalue("redis_server")
    server.flush()
    return ["--redis-url", server.url]


def open_where(where: list[str]):
    return open_store("sqlite" if where[0] == "--db" else "redis", where[1])


@pytest.fixture
def store(where):
    s = open_where(where)
    s.write_batch(RECORDS[::-1])                     # written out of order: the order comes from the store
    yield s
    s.close()


def ids(records) -> list[str]:
    return [r.request_id for r in records]


# ------------------------------------------------------------------------------------------- the stores
def test_store_requests_newest_first_with_every_value(store):
    got = store.requests()
    assert ids(got) == NEWEST_FIRST                                  # probes left out
    assert got == [BY_ID[i] for i in NEWEST_FIRST]                   # every field as written
    assert ids(store.requests(include_probes=True)) == ["r-g", "r-f", "r-e", PROBE_PREFIX + "1", "r-d", "r-c",
                                                        "r-b", "r-a"]
    assert ids(store.requests(limit=3)) == NEWEST_FIRST[:3]
    assert ids(store.requests(limit=1)) == ["r-g"]


def test_store_requests_filters(store):
    assert ids(store.requests(api_key_id="k_bob")) == ["r-e", "r-b"]
    assert ids(store.requests(api_key_id="")) == ["r-d"]                # requests without an API key
    assert ids(store.requests(api_key_id="", include_probes=True)) == [PROBE_PREFIX + "1", "r-d"]
    assert ids(store.requests(api_key_id="k_nobody")) == []
    assert ids(store.requests(model=B)) == ["r-e", "r-c"]
    assert ids(store.requests(api_key_id="k_bob", model=B)) == ["r-e"]
    assert ids(store.requests(since=T0 + 30)) == ["r-g", "r-f", "r-e", "r-d", "r-c"]     # finished_at >= since
    assert ids(store.requests(until=T0 + 30)) == ["r-b", "r-a"]                          # finished_at < until
    assert ids(store.requests(since=T0 + 20, until=T0 + 50, api_key_id="k_alice")) == ["r-c"]
    assert ids(store.requests(since=T0 + 10, until=T0 + 51, api_key_id="k_alice", limit=2)) == ["r-f", "r-c"]
    assert ids(store.requests(since=T0 + 3601)) == []
    with pytest.raises(ValueError, match="limit"):
        store.requests(limit=0)


def test_store_requests_pages_past_records_the_filter_skips(where):
    """A rare key among many newer records: Redis pages through ``by_finished``; SQLite's LIMIT still holds."""
    s = open_where(where)
    try:
        bulk = [rec(f"bulk-{i:04d}", T0 + 100 + i) for i in range(450)]
        rare = [rec(f"rare-{i}", T0 + 1 + i, key="k_rare") for i in range(5)]
        s.write_batch(bulk + rare)
        assert ids(s.requests(api_key_id="k_rare", limit=3)) == ["rare-4", "rare-3", "rare-2"]
        assert ids(s.requests(api_key_id="k_rare", limit=100)) == [f"rare-{i}" for i in range(4, -1, -1)]
        assert ids(s.requests(limit=250)) == [f"bulk-{i:04d}" for i in range(449, 199, -1)]
    finally:
        s.close()


# ------------------------------------------------------------------------------------------- the CLI
def test_cli_table_json_and_csv(store, where, capsys):
    assert cli.main(["report", "--requests", *where]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == HEAD
    assert [line.split() for line in lines[2:]] == [table_cells(BY_ID[i]) for i in NEWEST_FIRST]
    assert len({len(line) for line in lines}) == 1                      # aligned columns

    assert cli.main(["report", "--requests", "--json", "--key", "k_bob", *where]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {"since": None, "until": None, "key": "k_bob", "model": None, "limit": 100,
                    "rows": [json_row(BY_ID["r-e"]), json_row(BY_ID["r-b"])]}

    assert cli.main(["report", "--requests", "--json", "--model", B, *where]) == 0
    assert [r["request_id"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["r-e", "r-c"]

    assert cli.main(["report", "--requests", "--json", "--since", "2025-03-01T12:00:30Z", "--until",
                     "2025-03-01T12:00:50", *where]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["since"], data["until"]) == (T0 + 30, T0 + 50)
    assert [r["request_id"] for r in data["rows"]] == ["r-d", "r-c"]

    assert cli.main(["report", "--requests", "--json", "--limit", "2", "--include-probes", "--key", "", *where]) == 0
    assert [r["request_id"] for r in json.loads(capsys.readouterr().out)["rows"]] == [PROBE_PREFIX + "1", "r-d"]

    assert cli.main(["report", "--requests", "--csv", "--limit", "3", *where]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == HEAD
    assert rows[1:] == [[c if c != "-" else "" for c in table_cells(BY_ID[i])] for i in NEWEST_FIRST[:3]]

    assert cli.main(["report", "--requests", "--model", "no/such-model", *where]) == 0   # empty: the head only
    assert capsys.readouterr().out.splitlines()[0].split() == HEAD


def test_cli_relative_times(where, capsys):
    """``--since 2h`` / ``--until 30m``: that long before now."""
    now = time.time()
    s = open_where(where)
    try:
        s.write_batch([rec("old", now - 3 * 3600), rec("hour", now - 3600), rec("fresh", now - 60)])
    finally:
        s.close()
    assert cli.parse_time("15m", now=now) == now - 900
    assert cli.parse_time("1d", now=now) == now - 86400
    assert cli.parse_time("90s", now=now) == now - 90

    def listed(*flags: str) -> list[str]:
        assert cli.main(["report", "--requests", "--json", *flags, *where]) == 0
        return [r["request_id"] for r in json.loads(capsys.readouterr().out)["rows"]]

    assert listed("--since", "2h") == ["fresh", "hour"]
    assert listed("--until", "30m") == ["hour", "old"]
    assert listed("--since", "1d", "--until", "2h") == ["old"]
    assert listed("--since", "1w", "--limit", "1") == ["fresh"]


@pytest.mark.parametrize("flags, option, message", [
    (["--requests", "--since", "yesterday"], "--since", "not an ISO date/time nor an age"),
    (["--requests", "--until", "12:00 tomorrow"], "--until", "not an ISO date/time nor an age"),
    (["--requests", "--since", "5x"], "--since", "not an ISO date/time nor an age"),
    (["--requests", "--limit", "0"], "--limit", "must be at least 1, got 0"),
    (["--requests", "--limit", "-3"], "--limit", "must be at least 1, got -3"),
    (["--requests", "--limit", "ten"], "--limit", "not an integer"),
    (["--requests", "--by", "model"], "--by", "not allowed with --requests"),
    (["--key", "k_bob"], "--key", "only with --requests"),
    (["--limit", "5"], "--limit", "only with --requests"),
])
def test_cli_bad_input_is_an_argparse_error(tmp_path, capsys, flags, option, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", *flags, "--db", str(tmp_path / "ledger.sqlite3")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err and message in err
    assert not (tmp_path / "ledger.sqlite3").exists()


def test_cli_module_in_a_subprocess(tmp_path):
    """``python -m qwen_vllm_ext.usage report --requests``: the ledger of the data directory, or ``--db``."""
    s = open_store("sqlite", str(tmp_path / "ledger.sqlite3"))
    s.write_batch(RECORDS)
    s.close()
    env = {**os.environ, "QWEN_VLLM_EXT_DATA_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    env.pop("QWEN_VLLM_EXT_SETTINGS", None)

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "report", "--requests", *flags],
                              env=env, capture_output=True, text=True, timeout=60)

    p = run("--json", "--limit", "2", "--key", "k_alice")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["rows"] == [json_row(BY_ID["r-g"]), json_row(BY_ID["r-f"])]

    p = run("--db", str(tmp_path / "ledger.sqlite3"), "--model", B)
    assert p.returncode == 0, p.stderr
    assert [line.split() for line in p.stdout.splitlines()[2:]] == [table_cells(BY_ID["r-e"]),
                                                                   table_cells(BY_ID["r-c"])]

    p = run("--since", "last tuesday")
    assert p.returncode == 2 and p.stdout == ""
    assert "argument --since: not an ISO date/time nor an age: 'last tuesday'" in p.stderr
