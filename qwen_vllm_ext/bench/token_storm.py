"""TokenStorm: token-shaped load against an OpenAI-compatible server, with accounting and header checks.

    python -m qwen_vllm_ext.bench.token_storm --base-url http://localhost:8000 --model qwen3-demo \\
        --distribution long_tail --rate 4 --num-requests 200 --duration 120 --output-dir storm/

Every run is bounded by ``--num-requests`` and ``--duration`` (in-flight requests get ``--drain-s`` more, then
are cancelled and counted). Output: a terminal table, ``<output-dir>/token_storm.json`` (report + per-request
records) and ``<output-dir>/token_storm.png``. ``--strict`` exits 3 on any accounting mismatch or header-honesty
violation.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import uuid
from typing import Any

from ..client import APIConnectionError, APIError, AsyncClient, ClientError, RetryPolicy, SSEProtocolError
from . import analysis, report as report_mod
from .analysis import RequestRecord
from .field_mix import storm_extras
from .workload import ArrivalSpec, LengthSpec, Session, build_sessions, load_trace

RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-requests",
                "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
                "retry-after")
KEEPALIVE_EXPIRY_S = 2.0
"""The client drops a connection idle this long, before the server's keep-alive timeout (uvicorn: 5 s) closes it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="token-storm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", required=True, help="server root, e.g. http://localhost:8000 (a /v1 suffix is ok)")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=os.environ.get("TOKEN_STORM_API_KEY"),
                   help="bearer key (env TOKEN_STORM_API_KEY)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    w = p.add_argument_group("workload")
    w.add_argument("--distribution", default="normal",
                   help="fixed | normal | long_tail | burst | PATH.jsonl (a trace)")
    w.add_argument("--input-len", type=int, default=2000, help="prompt tokens (mean)")
    w.add_argument("--input-std", type=float, default=None, help="prompt std (default mean/4)")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens (mean)")
    w.add_argument("--output-std", type=float, default=0.0)
    w.add_argument("--tail-fraction", type=float, default=0.05)
    w.add_argument("--tail-max", type=int, default=10_000)
    w.add_argument("--max-model-len", type=int, default=None,
                   help="cap prompt + output (default: the server's max_model_len from /v1/models)")
    w.add_argument("--turns", type=int, default=1, help="turns per session (multi-turn conversations)")
    w.add_argument("--template", default="auto",
                   help="chat template the calculator counts with (qwen3, qwen3-reuse, qwen2.5, qwen3.5, "
                        "qwen3.5-reuse); auto: the one (and the vocabulary) whose count matches the server's "
                        "/tokenize on probe conversations")
    w.add_argument("--vocabulary", default="qwen3", choices=("qwen3", "qwen3.6"),
                   help="bundled vocabulary the calculator counts with (set with --template auto)")
    w.add_argument("--field-mix", type=float, default=0.0,
                   help="chat: fraction of requests that also set prompt-changing fields (reasoning_effort, "
                        "chat_template_kwargs.enable_thinking, tools with tool_choice none) and n=2 "
                        "(qwen_vllm_ext.bench.field_mix.storm_extras); counts and costs account for them")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals and bounds")
    a.add_argument("--rate", type=float, default=1.0, help="sessions per second (open loop)")
    a.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    a.add_argument("--gamma-shape", type=float, default=1.0)
    a.add_argument("--concurrency", type=int, default=0, help="> 0: closed loop with this many workers")
    a.add_argument("--burst-factor", type=float, default=4.0, help="rate multiplier inside bursts (burst)")
    a.add_argument("--burst-s", type=float, default=10.0)
    a.add_argument("--burst-period-s", type=float, default=60.0)
    a.add_argument("--num-requests", type=int, default=100)
    a.add_argument("--duration", type=float, default=300.0, help="seconds; no request starts after it")
    a.add_argument("--drain-s", type=float, default=60.0, help="grace for in-flight requests after --duration")
    r = p.add_argument_group("requests")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers other than vLLM)")
    r.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="do not ask for return_token_ids; streamed tokens are then counted as token-carrying chunks")
    r.add_argument("--no-chunk-usage-check", dest="chunk_usage", action="store_false",
                   help="the server does not send usage on every chunk")
    r.add_argument("--retries", type=int, default=0, help="client retries (SDK backoff); 0 counts every error")
    r.add_argument("--timeout", type=float, default=600.0)
    o = p.add_argument_group("checks and output")
    o.add_argument("--ledger", default=None,
                   help="ledger to check records against: a SQLite file (…/ledger.sqlite3) or redis:// URL")
    o.add_argument("--check-prices", action="store_true",
                   help="with --ledger: each record's cost must equal its usage x the prices the server publishes "
                        "(GET /v1/models?format=openrouter-legacy; the server runs with openrouter=true)")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--slo-e2e-ms", type=float, default=None)
    o.add_argument("--output-dir", default="token_storm_results")
    o.add_argument("--no-plot", dest="plot", action="store_false")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    o.add_argument("--strict", action="store_true", help="exit 3 on accounting mismatches or header violations")
    return p


def _validate(args, p: argparse.ArgumentParser) -> None:
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if not args.duration > 0:
        p.error("--duration must be > 0 (runs are always bounded)")
    if args.concurrency < 0 or args.turns < 1 or args.retries < 0:
        p.error("--concurrency must be >= 0, --turns >= 1, --retries >= 0")
    if args.concurrency == 0 and not args.rate > 0:
        p.error("--rate must be > 0 (or use --concurrency N for a closed loop)")
    if args.input_len < 1 or args.output_len < 1:
        p.error("--input-len and --output-len must be >= 1")


def server_max_model_len(base_url: str, model: str, api_key: str | None) -> int | None:
    import httpx

    base = base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=30)
        for m in r.json().get("data", []):
            if m.get("id") == model and isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return None


def listed_prices(base_url: str, model: str, api_key: str | None):
    """The prices the server's OpenRouter listing publishes for ``model`` (``qwen_v3_calculator.billing.Prices``)."""
    import httpx

    from ..provider.listing import prices_of

    base = base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base + "/v1/models", params={"format": "openrouter-legacy"}, headers=headers, timeout=30)
    r.raise_for_status()
    for m in r.json().get("data", []):
        if m.get("id") == model:
            return prices_of(m)
    raise LookupError(f"model {model!r} is not in the server's OpenRouter listing")


# Templates differ on earlier assistant turns (qwen3/qwen3.5 drop their think block, the reuse ones keep an empty
# one) and on a missing system message (qwen2.5 injects its default one): one probe of each.
PROBES = ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c"}], [{"role": "user", "content": "a"}])
CANDIDATE_TEMPLATES = (("qwen3", "qwen3"), ("qwen3", "qwen3-reuse"), ("qwen3", "qwen2.5"), ("qwen3.6", "qwen3.5"),
                       ("qwen3.6", "qwen3.5-reuse"))
"""(bundled vocabulary, chat template) pairs the calculator can count with."""


def detect_template(base_url: str, model: str, api_key: str | None) -> tuple[str, str, str]:
    """(vocabulary, template, how they were chosen): the candidate whose counts of probe conversations equal the
    counts of the server's own ``/tokenize`` (vLLM renders them with the template it serves)."""
    import httpx
    from qwen_v3_calculator import Calculator

    base = base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        served = [httpx.post(base + "/tokenize", headers=headers, json={"model": model, "messages": p},
                             timeout=30).json()["count"] for p in PROBES]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return "qwen3", "qwen3", f"qwen3 (default: the server's /tokenize did not answer: {exc!r})"
    for vocabulary, name in CANDIDATE_TEMPLATES:
        calc = Calculator(model=vocabulary)
        if [calc.count_chat(p, template=name) for p in PROBES] == served:
            return vocabulary, name, (f"{name}, {vocabulary} vocabulary (matches the server's /tokenize on probe "
                                      f"conversations)")
    return "qwen3", "qwen3", f"qwen3 (default: no known template gives the server's counts {served} for the probes)"


def make_sessions(args) -> list[Session]:
    if args.distribution.endswith(".jsonl"):
        return load_trace(args.distribution, args.num_requests, args.duration, args.max_model_len)
    lengths = LengthSpec(args.distribution, args.input_len, args.input_std, args.output_len, args.output_std,
                         tail_fraction=args.tail_fraction, tail_max=args.tail_max, max_model_len=args.max_model_len,
                         min_input=16 if args.endpoint == "chat" else 1)
    arrivals = ArrivalSpec(args.arrival, args.rate, args.gamma_shape, args.concurrency,
                           args.burst_factor if args.distribution == "burst" else 1.0, args.burst_s,
                           args.burst_period_s)
    return build_sessions(lengths, arrivals, args.num_requests, args.duration, args.seed, args.turns)


class Storm:
    def __init__(self, args, sessions: list[Session]):
        from .prompts import PromptFactory

        self.args = args
        self.sessions = sessions
        self.prompts = PromptFactory(seed=args.seed, template=args.template, model=args.vocabulary)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.bar = None
        import httpx

        # no connection-pool cap: a pool queue would show up as client-side TTFT. Idle connections expire after
        # KEEPALIVE_EXPIRY_S, well before the server closes them (uvicorn's keep-alive, vLLM's default 5 s: httpx's
        # default expiry is the same 5 s, so a request could go out on a connection the server is closing)
        http = httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self.client = AsyncClient(args.base_url, args.api_key, timeout=args.timeout, http_client=http,
                                  retry=RetryPolicy(max_retries=args.retries))
        # first turns are prepared before the clock starts (prompt cutting costs CPU)
        self.first_prompts = [self._first_prompt(s) for s in sessions]
        self.field_rng = random.Random(args.seed + 18)
        self.run_id = uuid.uuid4().hex[:12]  # session ids unique per run (a rerun is not "the same conversation")

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _first_prompt(self, s: Session):
        n = s.turns[0].prompt_tokens
        if self.args.endpoint == "chat":
            return self.prompts.chat(max(n, self.prompts.chat_overhead + 1))
        return self.prompts.text(n)

    async def run_session(self, s: Session, deadline: float) -> None:
        history = None
        for k, turn in enumerate(s.turns):
            if k and self.now() >= deadline:
                return
            rec = RequestRecord(index=len(self.records), session=s.index, turn=k, max_tokens=turn.output_tokens,
                                prompt_tokens_target=turn.prompt_tokens, scheduled_at=self.now())
            self.records.append(rec)
            if self.args.endpoint == "chat":
                if k == 0:
                    history = list(self.first_prompts[s.index])
                else:
                    history.append({"role": "user", "content": self.prompts.text(turn.prompt_tokens)})
                extra, calc_kwargs, rec.n = storm_extras(self.field_rng, self.args.field_mix)
                rec.prompt_tokens_calc = self.prompts.count_chat(history, **calc_kwargs)
                reply = await self.send(rec, {"messages": history, **extra}, self.session_id(s))
                if reply is None:
                    return
                history.append({"role": "assistant", "content": reply})
            else:
                prompt = self.first_prompts[s.index] if k == 0 else self.prompts.text(turn.prompt_tokens)
                rec.prompt_tokens_calc = self.prompts.count(prompt)
                if await self.send(rec, {"prompt": prompt}, self.session_id(s)) is None:
                    return

    def session_id(self, s: Session) -> str | None:
        """The conversation header of a multi-turn session (router affinity + reuse ratio); none for single turns."""
        return f"storm-{self.run_id}-{s.index}" if len(s.turns) > 1 else None

    async def send(self, rec: RequestRecord, payload: dict, session_id: str | None = None) -> str | None:
        a = self.args
        params: dict[str, Any] = {**payload, "max_tokens": rec.max_tokens,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if a.ignore_eos:
            params["ignore_eos"] = True
        if a.token_ids:
            params["return_token_ids"] = True
        path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
        text: list[str] = []
        rec.sent_at = self.now()
        try:
            stream = await self.client.request(path, params, a.model, stream=True, session_id=session_id)
            rec.headers_at = self.now()
            rec.request_id = stream.request_id
            rec.http_status = stream.status_code
            rec.rate_headers = {h: stream.headers[h] for h in RATE_HEADERS if h in stream.headers}
            async for chunk in stream:
                t = chunk.received_at - self.t0
                if chunk.is_usage_only:
                    rec.final_usage = chunk.usage
                    continue
                for choice in chunk.choices:
                    # with n > 1 each chunk carries one choice, and vLLM's per-chunk usage counts that choice's
                    # tokens; the per-chunk checks follow choice 0, the totals every choice
                    index = choice.get("index", 0)
                    ids = chunk.token_ids(index)
                    piece = chunk.content(index)
                    n = len(ids) if ids is not None else (1 if (piece or chunk.reasoning(index)) else 0)
                    if index == 0:
                        if chunk.usage is not None:
                            u = chunk.usage
                            rec.chunk_usages.append((int(u.get("prompt_tokens") or 0),
                                                     int(u.get("completion_tokens") or 0),
                                                     int(u.get("total_tokens") or 0)))
                            rec.chunk_tokens.append(n)
                        else:
                            rec.chunks_without_usage += 1
                        rec.first_choice_tokens += n
                        if piece:
                            text.append(piece)
                    if n:
                        rec.streamed_tokens += n
                        rec.token_times.append(t)
                        if rec.first_token_at is None:
                            rec.first_token_at = t
            rec.end_at = self.now()
            if rec.final_usage is None and rec.chunk_usages:
                p, c, tot = rec.chunk_usages[-1]
                rec.final_usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": tot}
            details = (rec.final_usage or {}).get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
            rec.token_ids_counted = a.token_ids
            rec.status = "ok"
            return "".join(text)
        except APIError as exc:
            rec.end_at = self.now()
            if rec.headers_at is None:
                rec.headers_at = rec.end_at
                rec.rate_headers = {h: exc.headers[h] for h in RATE_HEADERS if h in exc.headers}
                rec.request_id = exc.request_id
            rec.status = "stream_error" if exc.mid_stream else "http_error"
            rec.http_status = exc.status_code if not exc.mid_stream else rec.http_status
            rec.error_code, rec.error_type, rec.error_message = exc.code, exc.type, exc.message
        except SSEProtocolError as exc:
            rec.end_at, rec.status, rec.error_message = self.now(), "protocol_error", str(exc)
        except (APIConnectionError, ClientError) as exc:
            rec.end_at, rec.status, rec.error_message = self.now(), "connection_error", str(exc)
        except asyncio.CancelledError:
            rec.end_at, rec.status = self.now(), "cancelled"
            raise
        finally:
            if self.bar is not None:
                self.bar.update(1)
        return None

    async def run(self) -> list[RequestRecord]:
        a = self.args
        total = sum(len(s.turns) for s in self.sessions)
        if a.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="token-storm", unit="req", file=sys.stderr)
        self.t0 = time.perf_counter()
        deadline = a.duration
        tasks: list[asyncio.Task] = []
        if a.concurrency:
            queue = list(self.sessions)

            async def worker():
                while queue and self.now() < deadline:
                    await self.run_session(queue.pop(0), deadline)

            tasks = [asyncio.create_task(worker()) for _ in range(a.concurrency)]
        else:
            for s in self.sessions:
                delay = (s.arrival_s or 0.0) - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.now() >= deadline:
                    break
                tasks.append(asyncio.create_task(self.run_session(s, deadline)))
        if tasks:
            remaining = max(0.0, deadline - self.now()) + a.drain_s
            done, pending = await asyncio.wait(tasks, timeout=remaining)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        for r in self.records:
            if r.status == "pending":
                r.status = "cancelled"
        if self.bar is not None:
            self.bar.close()
        await self.client.aclose()
        return self.records


def read_ledger(location: str, request_ids: list[str]) -> dict[str, dict]:
    from ..usage.ledger import open_store

    backend = "redis" if location.startswith(("redis://", "rediss://", "unix://")) else "sqlite"
    if backend == "sqlite" and not os.path.isfile(location):
        raise FileNotFoundError(f"--ledger {location}: no such SQLite ledger file")
    store = open_store(backend, location)
    try:
        out = {}
        for rid in request_ids:
            rec = store.get(rid)
            if rec is not None:
                out[rid] = rec.to_dict()
        return out
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _validate(args, p)
    if args.max_model_len is None:
        args.max_model_len = server_max_model_len(args.base_url, args.model, args.api_key)
    template_note = args.template
    if args.template == "auto":
        args.vocabulary, args.template, template_note = detect_template(args.base_url, args.model, args.api_key)
    try:
        sessions = make_sessions(args)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    storm = Storm(args, sessions)
    started = time.time()
    records = asyncio.run(storm.run())
    slos = {k: v / 1000.0 for k, v in (("ttft_s", args.slo_ttft_ms), ("tpot_s", args.slo_tpot_ms),
                                      ("e2e_s", args.slo_e2e_ms)) if v is not None}
    prices = listed_prices(args.base_url, args.model, args.api_key) if args.check_prices else None
    ledger = None
    if args.ledger:
        ledger = read_ledger(args.ledger, [r.request_id for r in records if r.ok and r.request_id])
    rep = analysis.analyse(records, slos, ledger, check_ledger=bool(args.ledger),
                           expect_chunk_usage=args.chunk_usage, prices=prices)
    rep["run"] = {"started_at": started, "argv": sys.argv[1:] if argv is None else list(argv),
                  "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
                  "distribution": args.distribution, "max_model_len": args.max_model_len,
                  "template": template_note,
                  "planned_requests": sum(len(s.turns) for s in sessions)}
    print(f"chat template for the calculator: {template_note}")
    print(report_mod.table(rep))
    os.makedirs(args.output_dir, exist_ok=True)
    json_path = os.path.join(args.output_dir, "token_storm.json")
    report_mod.write_json({**rep, "records": [r.to_dict() for r in records]}, json_path)
    print(f"JSON: {json_path}")
    if args.plot:
        png = os.path.join(args.output_dir, "token_storm.png")
        report_mod.plot(rep, [r.ttft for r in records if r.ok and r.ttft is not None], png)
        print(f"PNG: {png}")
    bad = rep["accounting"]["mismatches"] or rep["header_honesty"]["violations"]
    return 3 if (args.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
