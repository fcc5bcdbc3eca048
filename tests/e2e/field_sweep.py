"""Every request field vLLM accepts, alone and in mixed batches, against a live demo server (issue 46).

No request field may kill the engine. Each field of the installed vLLM's ``ChatCompletionRequest`` and
``CompletionRequest`` (``gateway.vllm_requests.request_fields``: a field vLLM adds fails here until
``bench.field_mix.FIELD_VALUES`` gives it values) is sent with each of its values on a minimal request, several at
once, then in concurrent batches of requests that each mix several fields (seeded and unseeded, logprobs, structured
outputs, n, streams, penalties ... in one engine batch). Every response is a 200 (a stream that ends in ``[DONE]``
with no error event) or a 400 whose error names one of the fields the request set; afterwards the server is healthy
and answers. Used by ``test_gateway.py`` (the Qwen3 demo) and ``test_hybrid_demo.py`` (the Qwen3.6 demo).
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


IMPLIED = {"tools": ("tool choice",)}
"""Fields a 400 may name for another field it implies: ``tools`` without ``tool_choice`` means ``"auto"``, which
vLLM refuses ("auto" tool choice requires --tool-call-parser) on a server without a tool parser."""


def bases(model: str) -> dict:
    return {"chat": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            "completion": {"model": model, "prompt": "hi", "max_tokens": 3}}


def cases(model: str, seed: int, batches: int, batch_size: int) -> tuple[list, list]:
    """(alone, mixed): lists of (kind, fields set, body); ``mixed`` is ``batches`` lists of ``batch_size``."""
    from qwen_vllm_ext.bench.field_mix import FIELD_VALUES, field_combination

    base = bases(model)
    alone = [(kind, (field,), {**base[kind], field: value})
             for kind, table in FIELD_VALUES.items() for field, values in sorted(table.items()) for value in values]
    rng = random.Random(seed)
    mixed = []
    for b in range(batches):
        batch = []
        for i in range(batch_size):
            kind = ("chat", "completion")[(b + i) % 2]
            fields = field_combination(rng, kind, rng.randint(3, 6))
            batch.append((kind, tuple(sorted(fields)), {**base[kind], **fields}))
        mixed.append(batch)
    return alone, mixed


def verdict(fields: tuple, status: int, text: str) -> str | None:
    """None when the answer is what a client may get; else what is wrong."""
    if status == 200:
        if text.startswith("data:") or "\ndata:" in text[:200]:
            events = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
            if not events or events[-1] != "[DONE]":
                return "a stream that does not end in [DONE]"
            if any('"error"' in e and e.startswith('{"error"') for e in events):
                return "an error event inside a 200 stream"
        return None
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an OpenAI-shaped error"
    if status != 400:
        return f"{status} {error.get('code')}"
    named = f"{error.get('message', '')} {error.get('param') or ''}"
    names = {n for f in fields for n in (f, f.replace("_", " "), *IMPLIED.get(f, ()))}
    if not any(n in named for n in names):
        return f"a 400 that names none of {fields}: {error.get('message', '')[:160]!r}"
    return None


async def _send(client, key, kind, fields, body, gate, out):
    async with gate:
        try:
            r = await client.post(PATHS[kind], headers={"authorization": f"Bearer {key}"}, json=body)
            status, text = r.status_code, r.text
        except httpx.TransportError as exc:  # a dropped connection is as bad as a 5xx
            status, text = 599, repr(exc)
    out.append((kind, fields, body, status, text, verdict(fields, status, text) if status != 599 else "no answer"))


def sweep(base_url: str, new_key, model: str, seed: int = 46, batches: int = 4, batch_size: int = 12,
          concurrency: int = 8, per_key: int = 30) -> dict:
    """Run the sweep; ``new_key()`` returns a key secret (a fresh one every ``per_key`` requests: a server with
    the spike breaker on would suspend one key that sends them all). Returns counts for the test's message."""
    from qwen_vllm_ext.bench.field_mix import FIELD_VALUES
    from qwen_vllm_ext.gateway.vllm_requests import request_fields

    accepted = request_fields()
    for kind in FIELD_VALUES:
        missing = accepted[kind] - set(FIELD_VALUES[kind])
        assert not missing, f"{kind}: vLLM accepts fields the sweep has no value for: {sorted(missing)}"
    alone, mixed = cases(model, seed, batches, batch_size)
    keys = [new_key() for _ in range(-(-(len(alone) + batches * batch_size) // per_key))]

    async def run():
        out_alone, out_mixed = [], []
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            gate = asyncio.Semaphore(concurrency)
            await asyncio.gather(*(_send(client, keys[i // per_key], kind, fields, body, gate, out_alone)
                                   for i, (kind, fields, body) in enumerate(alone)))
            offset = len(alone)
            for batch in mixed:  # a whole batch at once: the engine schedules the requests together
                wide = asyncio.Semaphore(len(batch))
                await asyncio.gather(*(_send(client, keys[(offset + i) // per_key], kind, fields, body, wide,
                                             out_mixed) for i, (kind, fields, body) in enumerate(batch)))
                offset += len(batch)
        return out_alone, out_mixed

    out_alone, out_mixed = asyncio.run(run())
    bad = [(kind, fields, json.dumps(body)[:200], status, problem, text[:300])
           for kind, fields, body, status, text, problem in out_alone + out_mixed if problem]
    assert not bad, "\n".join(map(repr, bad))
    with httpx.Client(base_url=base_url, timeout=120) as client:  # the engine is still up and serving
        assert client.get("/health").status_code == 200
        r = client.post(PATHS["chat"], headers={"authorization": f"Bearer {new_key()}"}, json=bases(model)["chat"])
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    fields_ok = {(k, f[0]) for k, f, _, s, _, _ in out_alone if s == 200}
    return {"alone": len(out_alone), "alone_200": sum(1 for o in out_alone if o[3] == 200),
            "fields_answered_200": len(fields_ok), "mixed": len(out_mixed),
            "mixed_200": sum(1 for o in out_mixed if o[3] == 200),
            "refused_alone": sorted({f"{k}.{f[0]}" for k, f, _, s, _, _ in out_alone if s != 200})}
