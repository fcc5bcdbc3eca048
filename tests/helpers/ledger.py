"""Usage-ledger records for tests: deterministic records to write (``make``), and the record a live server wrote
(``ledger_row``)."""
import calendar
import time

from qwen_vllm_ext.usage.ledger import STATUSES, LedgerRecord, SqliteLedgerStore

DAY0 = float(calendar.timegm((2025, 3, 1, 0, 0, 0)))      # a UTC midnight
KEYS = ["key-a", "key-b", "key:c", None]                   # None = gateway off
MODELS = ["Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"]


def make(rid: str, i: int = 0, **kw) -> LedgerRecord:
    """A deterministic record; billing: input 1.0, cached 0.1, output 1.35 (all in integer micro-units)."""
    prompt, completion = 10 + i % 97, 1 + i % 53
    cached = min(prompt, (i % 7) * 3)
    data = dict(request_id=rid, instance_id=f"inst-{i % 2}", model=MODELS[i % 2], endpoint="/v1/chat/completions",
                status=STATUSES[i % 5], http_status=200, prompt_tokens=prompt, cached_tokens=cached,
                completion_tokens=completion, reasoning_tokens=i % 5, engine_prompt_tokens=prompt,
                billed_prompt_micro=(prompt - cached) * 1_000_000 + cached * 100_000,
                billed_completion_micro=completion * 1_350_000,
                received_at=DAY0 + i * 97.3, finished_at=DAY0 + i * 97.3 + 1.25, ttft_s=0.05 if i % 3 else None,
                latency_s=1.25, streamed=bool(i % 2), api_key_id=KEYS[i % 4],
                cost_pico_usd=(prompt - cached) * 150_000 + cached * 75_000 + completion * 600_000)  # $0.15/0.075/0.6 per M
    data.update(kw)
    return LedgerRecord(**data)


def ledger_row(data, request_id, timeout=30):
    """The record of ``request_id`` in the SQLite ledger of the data dir ``data``, as a dict (waited for)."""
    store = SqliteLedgerStore(str(data / "ledger.sqlite3"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = store.get(request_id)
        if record is not None:
            return record.to_dict()
        time.sleep(0.2)
    raise AssertionError(f"no ledger record for {request_id}")
