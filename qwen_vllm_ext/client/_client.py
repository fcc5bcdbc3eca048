"""Sync and async clients for any OpenAI-compatible server (httpx underneath).

Both share the request building, error mapping and retry decisions; only the I/O differs. Streams yield
:class:`~qwen_vllm_ext.client.sse.StreamChunk` objects (usage exposed per chunk) and keep the response headers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import AsyncIterator, Callable, Iterator

import httpx

from .buffer import AdaptiveBuffer
from .errors import APIConnectionError, APIError, APITimeoutError, ServerError, error_from_response
from .retry import RetryPolicy
from .sse import StreamChunk, StreamDecoder

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SESSION_HEADER = "X-Session-ID"  # = qwen_vllm_ext.kv.reuse.SESSION_HEADER (a unit test holds them equal)


def new_request_id() -> str:
    return "tsk-" + uuid.uuid4().hex


@dataclasses.dataclass
class Result:
    """A non-streamed response."""

    body: dict
    status_code: int
    headers: dict
    model: str
    attempts: int

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    @property
    def usage(self) -> dict | None:
        return self.body.get("usage")

    @property
    def text(self) -> str | None:
        choices = self.body.get("choices") or [{}]
        c = choices[0]
        return (c.get("message") or {}).get("content") if "message" in c else c.get("text")


class _Base:
    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0,
                 retry: RetryPolicy | None = None, fallback_models: list[str] | tuple = (),
                 headers: dict | None = None, on_retry: Callable[[int, BaseException, float], None] | None = None,
                 require_done: bool = True):
        base = base_url.rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.api_key = api_key
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.fallback_models = list(fallback_models)
        self.extra_headers = dict(headers or {})
        self.on_retry = on_retry
        self.require_done = require_done

    def _headers(self, request_id: str, session_id: str | None = None) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
             "X-Request-ID": request_id, **self.extra_headers}
        if session_id is not None:  # the conversation: vllm-router's consistent_hash and the reuse tracker read it
            h[SESSION_HEADER] = session_id
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    @staticmethod
    def _body(model: str | None, params: dict, stream: bool) -> dict:
        body = {k: v for k, v in params.items() if v is not None}
        if model is not None:
            body["model"] = model
        if stream:
            body["stream"] = True
        if "model" not in body:
            raise ValueError("model is required")
        return body

    def _plan(self, body: dict, request_id: str | None):
        """Generator of (attempt, model, request id) driven by the exception of the previous attempt."""
        chain = [body["model"], *[m for m in self.fallback_models if m != body["model"]]]
        base_id = request_id or new_request_id()
        attempt, retries, idx = 0, 0, 0
        while True:
            rid = base_id if attempt == 0 else f"{base_id}-{attempt}"
            exc = yield attempt, chain[idx], rid
            attempt += 1
            if isinstance(exc, ServerError) and not exc.mid_stream and idx + 1 < len(chain):
                idx += 1  # fall back to the next model at once
                yield 0.0
                continue
            retries += 1
            delay = self.retry.delay(retries, exc)
            if delay is None:
                yield None
                return
            if self.on_retry is not None:
                self.on_retry(retries, exc, delay)
            yield delay


def _map_transport(exc: Exception) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"timed out: {exc!r}")
    return APIConnectionError(f"connection failed: {exc!r}")


class Stream:
    """A streamed response (sync): iterate for chunks; ``headers``, ``request_id``, ``usage`` (latest seen)."""

    def __init__(self, response: httpx.Response, model: str, attempts: int, require_done: bool):
        self.response = response
        self.status_code = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        self.model = model
        self.attempts = attempts
        self.decoder = StreamDecoder(response.status_code, self.headers, require_done)
        self.usage: dict | None = None
        self.chunks = 0

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    def _track(self, chunk: StreamChunk) -> StreamChunk:
        self.chunks += 1
        if chunk.usage is not None:
            self.usage = chunk.usage
        return chunk

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            try:
                for data in self.response.iter_bytes():
                    for chunk in self.decoder.feed(data):
                        yield self._track(chunk)
            except httpx.TransportError as exc:
                raise _map_transport(exc) from exc
            self.decoder.close()
        finally:
            self.close()

    def iter_text(self, expected_tokens: int | None = None, **buffer_options) -> Iterator[str]:
        """Text pieces through the adaptive buffer."""
        buf = AdaptiveBuffer(expected_tokens, **buffer_options)
        for chunk in self:
            yield from buf.push(chunk.text)
        rest = buf.flush()
        if rest:
            yield rest

    def close(self):
        self.response.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncStream(Stream):
    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._aiter()

    async def _aiter(self):
        try:
            try:
                async for data in self.response.aiter_bytes():
                    for chunk in self.decoder.feed(data):
                        yield self._track(chunk)
            except httpx.TransportError as exc:
                raise _map_transport(exc) from exc
            self.decoder.close()
        finally:
            await self.aclose()

    async def aiter_text(self, expected_tokens: int | None = None, **buffer_options):
        buf = AdaptiveBuffer(expected_tokens, **buffer_options)
        async for chunk in self:
            for piece in buf.push(chunk.text):
                yield piece
        rest = buf.flush()
        if rest:
            yield rest

    def __iter__(self):
        raise TypeError("AsyncStream: use 'async for'")

    async def aclose(self):
        await self.response.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


class Client(_Base):
    """Synchronous client. ``chat(...)`` / ``completions(...)`` return a :class:`Result` or a :class:`Stream`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, http_client: httpx.Client | None = None,
                 **options):
        super().__init__(base_url, api_key, **options)
        self._http = http_client or httpx.Client(timeout=self.timeout)

    def chat(self, messages: list, model: str | None = None, stream: bool = False,
             request_id: str | None = None, session_id: str | None = None, **params) -> Result | Stream:
        return self.request(CHAT_PATH, {"messages": messages, **params}, model, stream, request_id, session_id)

    def completions(self, prompt, model: str | None = None, stream: bool = False,
                    request_id: str | None = None, session_id: str | None = None, **params) -> Result | Stream:
        return self.request(COMPLETIONS_PATH, {"prompt": prompt, **params}, model, stream, request_id, session_id)

    def request(self, path: str, params: dict, model: str | None = None, stream: bool = False,
                request_id: str | None = None, session_id: str | None = None):
        body = self._body(model, params, stream)
        plan = self._plan(body, request_id)
        attempt, use_model, rid = next(plan)
        while True:
            try:
                return self._once(path, {**body, "model": use_model}, stream, rid, use_model, attempt + 1,
                                  session_id)
            except (APIError, APIConnectionError) as exc:
                delay = plan.send(exc)
                if delay is None:
                    raise
                time.sleep(delay)
                attempt, use_model, rid = next(plan)

    def _once(self, path, body, stream, rid, model, attempts, session_id=None):
        req = self._http.build_request("POST", self.base_url + path, json=body, headers=self._headers(rid, session_id))
        try:
            resp = self._http.send(req, stream=stream)
        except httpx.TransportError as exc:
            raise _map_transport(exc) from exc
        if resp.status_code >= 400:
            try:
                content = resp.read()
            except httpx.TransportError as exc:
                raise _map_transport(exc) from exc
            finally:
                resp.close()
            raise error_from_response(resp.status_code, content, resp.headers)
        if stream:
            return Stream(resp, model, attempts, self.require_done)
        return Result(resp.json(), resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, model,
                      attempts)

    def close(self):
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    """Asynchronous twin of :class:`Client` (``await client.chat(...)``; streams with ``async for``)."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 http_client: httpx.AsyncClient | None = None, **options):
        super().__init__(base_url, api_key, **options)
        self._http = http_client or httpx.AsyncClient(timeout=self.timeout)

    async def chat(self, messages: list, model: str | None = None, stream: bool = False,
                   request_id: str | None = None, session_id: str | None = None, **params):
        return await self.request(CHAT_PATH, {"messages": messages, **params}, model, stream, request_id, session_id)

    async def completions(self, prompt, model: str | None = None, stream: bool = False,
                          request_id: str | None = None, session_id: str | None = None, **params):
        return await self.request(COMPLETIONS_PATH, {"prompt": prompt, **params}, model, stream, request_id, session_id)

    async def request(self, path: str, params: dict, model: str | None = None, stream: bool = False,
                      request_id: str | None = None, session_id: str | None = None):
        body = self._body(model, params, stream)
        plan = self._plan(body, request_id)
        attempt, use_model, rid = next(plan)
        while True:
            try:
                return await self._once(path, {**body, "model": use_model}, stream, rid, use_model, attempt + 1,
                                        session_id)
            except (APIError, APIConnectionError) as exc:
                delay = plan.send(exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                attempt, use_model, rid = next(plan)

    async def _once(self, path, body, stream, rid, model, attempts, session_id=None):
        req = self._http.build_request("POST", self.base_url + path, json=body, headers=self._headers(rid, session_id))
        try:
            resp = await self._http.send(req, stream=stream)
        except httpx.TransportError as exc:
            raise _map_transport(exc) from exc
        if resp.status_code >= 400:
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise _map_transport(exc) from exc
            finally:
                await resp.aclose()
            raise error_from_response(resp.status_code, content, resp.headers)
        if stream:
            return AsyncStream(resp, model, attempts, self.require_done)
        return Result(resp.json(), resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, model,
                      attempts)

    async def aclose(self):
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
