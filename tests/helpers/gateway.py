"""Clients of the in-server gateway: the test servers' admin key, keys created with the keys CLI, chats with a key,
bursts of simultaneous requests, and the field-coverage mix with its exact admission check."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from qwen_vllm_ext.demo import SERVED_NAME

ADMIN = "admin-secret-for-tests-0001"
HI = [{"role": "user", "content": "hi"}]  # 9 prompt tokens with the Qwen3 template


def make_key(data_dir: Path, *args, redis_url: str | None = None) -> dict:
    extra = ["--redis-url", redis_url] if redis_url else []
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "create", "--json", *extra, *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ,
                                                                           "QWEN_VLLM_EXT_DATA_DIR": str(data_dir)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def chat(client, secret, messages=HI, max_tokens=5, model=SERVED_NAME, **extra):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                       json={"model": model, "messages": messages, "max_tokens": max_tokens,
                             "ignore_eos": True, **extra})


def auth(secret):
    return {"Authorization": f"Bearer {secret}"}


def barrier_burst(server, secret, n=200, max_tokens=5, request=None):
    """n requests released at once by a barrier; returns the responses. ``request(client, i)`` sends request i
    (default: a short chat with ``secret``)."""
    barrier = threading.Barrier(n)
    results = [None] * n
    send = request or (lambda client, i: chat(client, secret, max_tokens=max_tokens))

    def worker(i):
        with httpx.Client(base_url=server.base_url, timeout=600) as client:
            barrier.wait()
            results[i] = send(client, i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def usage_counts(kind, response) -> tuple[int, int]:
    """(prompt tokens the engine computed, total tokens) from an OpenAI or Anthropic response's usage."""
    usage = response.json()["usage"]
    if kind != "messages":
        return usage["prompt_tokens"], usage["total_tokens"]
    prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (
        usage.get("cache_creation_input_tokens") or 0)  # Anthropic's input_tokens excludes the cached part
    return prompt, prompt + usage["output_tokens"]


def run_field_mix(server, seed, count, name, model=SERVED_NAME, workers=4):
    """Send the seeded field mix in chunks of one fresh key each, ``workers`` chunks at once (a key's window holds
    its own chunk only); per request, the admission count must equal the engine's prompt tokens; per chunk, the
    key's TPM window must hold exactly what usage says was used. Returns the outcomes in the mix's order."""
    from concurrent.futures import ThreadPoolExecutor

    from qwen_vllm_ext.bench.field_mix import PATHS, bodies, fields_set
    from qwen_vllm_ext.gateway.request_fields import FIELDS

    mix = bodies(seed, count, model)
    tpm, size = 10**6, 10  # 10 requests per key stay under the test server's spike threshold

    def one_chunk(start):
        outcomes, covered = [], {kind: set() for kind in PATHS}
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            key = client.post("/qwen_ext/admin/keys", headers=auth(ADMIN), json={
                "name": f"{name}-{start}", "tpm": tpm, "rpm": 100000, "max_tokens_cap": 4}).json()
            began, used = time.monotonic(), 0
            for kind, body in mix[start:start + size]:
                covered[kind] |= fields_set(body, FIELDS[kind])
                r = client.post(PATHS[kind], headers=auth(key["key"]), json=body)
                error = r.json().get("error") if r.status_code != 200 else None
                outcomes.append((kind, body, r.status_code, error.get("code") if error else None))
                if r.status_code == 200:
                    prompt, total = usage_counts(kind, r)
                    assert int(r.headers["x-qwen-prompt-tokens"]) == prompt, (kind, body, r.json()["usage"])
                    assert total <= int(r.headers["x-qwen-reserved-tokens"]), (kind, body, r.json()["usage"])
                    used += total
                elif error.get("code") == "unsupported_parameter":
                    assert r.status_code == 400 and error["param"], r.text
            time.sleep(0.3)  # the last reconciliation
            probe = chat(client, key["key"], max_tokens=1, model=model)
            assert time.monotonic() - began < 55, "a chunk outlived the 60 s window: the sum below would be wrong"
            assert int(probe.headers["x-ratelimit-remaining-tokens"]) == \
                tpm - used - int(probe.headers["x-qwen-reserved-tokens"]), (name, start)
        return outcomes, covered

    with ThreadPoolExecutor(workers) as pool:
        chunks = list(pool.map(one_chunk, range(0, len(mix), size)))
    outcomes = [o for chunk, _ in chunks for o in chunk]
    covered = {kind: set().union(*(c[kind] for _, c in chunks)) for kind in PATHS}
    return outcomes, covered
