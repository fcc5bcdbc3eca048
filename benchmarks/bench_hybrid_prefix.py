#!/usr/bin/env python
"""Prefix-cache reuse across the turns of one conversation on the hybrid demo (``--model qwen36-demo``), per config.

For each config a fresh server is started through the launcher (``python -m qwen_vllm_ext.serve --model qwen36-demo``
plus the config's flags), one conversation (each request generates ``--max-tokens``) of ``--requests`` requests is sent (request k = the previous request's
messages + a canned assistant answer of ``--answer-tokens`` tokens + a new user message of ``--new-tokens`` tokens;
the official Qwen3.5 template, thinking on unless ``--no-thinking``), and per request the prompt tokens and the
cached tokens vLLM reports are recorded, plus the KV-cache usage (``vllm:kv_cache_usage_perc``) after the last one.

Configs (``--configs``, comma-separated); all but ``product`` run with the extension's turn checkpoints off
(``QWEN_VLLM_EXT_KV_TURN_CHECKPOINTS=false``), i.e. vLLM's own checkpoints:
  stock       --prefix-match-unit 640 (hits only at the raised 640-token attention block: vLLM's behaviour without
              the flag) and retention 0 (vLLM's default: semantic checkpoints only)
  unit16      --prefix-match-unit 16 (what the launcher adds for the family), retention 0
  dense       --prefix-match-unit 16 --prefix-cache-retention-interval None (checkpoints kept densely)
  periodic    --prefix-match-unit 16 --prefix-cache-retention-interval 640 (a checkpoint every block)
  product     the launcher's defaults: --prefix-match-unit 16 and the extension's turn checkpoints

Per request: prompt tokens, ``shared`` (the longest prefix its prompt ids share with the previous request's, from
vLLM's ``/tokenize``; the answers are canned, so the previous completion is never part of it) and each config's
cached tokens. The best any config can do is ``shared`` floored to the match unit (16).

    .venv/bin/python benchmarks/bench_hybrid_prefix.py --out benchmarks/results/hybrid_prefix.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen_vllm_ext.bench.prompts import PromptFactory  # noqa: E402
from qwen_vllm_ext.bench.server import ServeProcess  # noqa: E402
from qwen_vllm_ext.kv.reuse import common_prefix  # noqa: E402

OFF = {"QWEN_VLLM_EXT_KV_TURN_CHECKPOINTS": "false"}  # the extension's turn checkpoints off: vLLM's checkpoints
CONFIGS = {  # name -> (flags, environment)
    "stock": (["--prefix-match-unit", "640"], OFF),
    "unit16": ([], OFF),
    "dense": (["--prefix-cache-retention-interval", "None"], OFF),
    "periodic": (["--prefix-cache-retention-interval", "640"], OFF),
    "product": ([], {}),
}
MODEL = "qwen36-demo"


def conversation(requests: int, new_tokens: int, answer_tokens: int, seed: int = 0) -> list[list[dict]]:
    """The message lists of each request (request 0: one user message)."""
    pf = PromptFactory(seed=seed, template="qwen3.5", model="qwen3.6")
    msgs = [{"role": "user", "content": pf.text(new_tokens)}]
    out = [list(msgs)]
    for _ in range(requests - 1):
        msgs = msgs + [{"role": "assistant", "content": pf.text(answer_tokens)},
                       {"role": "user", "content": pf.text(new_tokens)}]
        out.append(list(msgs))
    return out


def kv_usage(base_url: str) -> float | None:
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return None


def run_config(name: str, convo: list[list[dict]], thinking: bool, logdir: str, max_tokens: int = 16) -> dict:
    flags, env = CONFIGS[name]
    server = ServeProcess(["--model", MODEL, *flags], os.path.join(logdir, f"{name}.log"), label=name,
                          env={**os.environ, **env})
    try:
        server.wait_healthy(600)
        rows = []
        prev_ids: list[int] = []
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            for k, messages in enumerate(convo):
                tok = c.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True,
                                                "chat_template_kwargs": {"enable_thinking": thinking}})
                tok.raise_for_status()
                ids = tok.json()["tokens"]
                shared, prev_ids = common_prefix(prev_ids, ids), ids
                # streamed: the extension puts cached tokens on every chunk's usage (a plain response has them only
                # with --enable-prompt-tokens-details)
                u = None
                with c.stream("POST", "/v1/chat/completions", json={
                        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True, "chat_template_kwargs": {"enable_thinking": thinking}}) as s:
                    s.raise_for_status()
                    for line in s.iter_lines():
                        if line.startswith("data: {"):
                            u = json.loads(line[6:]).get("usage") or u
                assert u["prompt_tokens"] == len(ids), (u["prompt_tokens"], len(ids))
                rows.append({"request": k, "prompt_tokens": u["prompt_tokens"], "shared": shared,
                             "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
        return {"config": name, "flags": flags, "env": env, "rows": rows, "kv_cache_usage_perc": kv_usage(server.base_url)}
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=120)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--no-thinking", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16, help="generated per request (the answer is canned)")
    ap.add_argument("--out", default="benchmarks/results/hybrid_prefix.json")
    args = ap.parse_args(argv)
    convo = conversation(args.requests, args.new_tokens, args.answer_tokens)
    results = []
    with tempfile.TemporaryDirectory() as logdir:
        for name in args.configs.split(","):
            started = time.monotonic()
            results.append(run_config(name, convo, not args.no_thinking, logdir, args.max_tokens))
            print(f"{name}: {time.monotonic() - started:.0f}s", file=sys.stderr)
    print(f"{'request':>7} {'prompt':>6} {'shared':>6} " + " ".join(f"{r['config']:>9}" for r in results))
    for k in range(args.requests):
        row = results[0]['rows'][k]
        print(f"{k:>7} {row['prompt_tokens']:>6} {row['shared']:>6} "
              + " ".join(f"{r['rows'][k]['cached_tokens']:>9}" for r in results))
    print("kv use  " + " ".join(f"{r['kv_cache_usage_perc']}" for r in results))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
