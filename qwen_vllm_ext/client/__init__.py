"""Client SDK for OpenAI-compatible servers (vLLM with qwen-vllm-ext, or any other).

    from qwen_vllm_ext.client import Client
    with Client("http://localhost:8000", api_key="qve-…", fallback_models=["qwen3-small"]) as c:
        for chunk in c.chat([{"role": "user", "content": "hi"}], model="qwen3-demo", stream=True):
            print(chunk.text or "", end="", flush=True)   # chunk.usage: cumulative usage on every chunk

Pieces: :mod:`.sse` (incremental SSE parser and stream decoder), :mod:`.buffer` (adaptive streaming buffer),
:mod:`.retry` (backoff honouring ``Retry-After`` / ``x-ratelimit-reset-*``), :mod:`.errors` (typed exceptions).
"""
from .buffer import AdaptiveBuffer, flush_threshold
from .errors import (APIConnectionError, APIError, APITimeoutError, AuthenticationError, BadRequestError,
                     ClientError, ContextLengthExceededError, IncompleteStreamError, InsufficientQuotaError,
                     NotFoundError, PermissionDeniedError, RateLimitError, RequestTooLargeError, ServerError,
                     ServiceUnavailableError, SSEProtocolError, StreamError, error_from_body, error_from_response)
from .retry import NO_RETRIES, RetryPolicy, parse_duration, parse_retry_after
from .sse import SSEEvent, SSEParser, StreamChunk, StreamDecoder
from ._client import SESSION_HEADER, AsyncClient, AsyncStream, Client, Result, Stream, new_request_id

__all__ = [
    "SESSION_HEADER",
    "AdaptiveBuffer", "flush_threshold", "APIConnectionError", "APIError", "APITimeoutError", "AuthenticationError",
    "BadRequestError", "ClientError", "ContextLengthExceededError", "IncompleteStreamError",
    "InsufficientQuotaError", "NotFoundError", "PermissionDeniedError", "RateLimitError", "RequestTooLargeError",
    "ServerError", "ServiceUnavailableError", "SSEProtocolError", "StreamError", "error_from_body",
    "error_from_response", "NO_RETRIES", "RetryPolicy", "parse_duration", "parse_retry_after", "SSEEvent",
    "SSEParser", "StreamChunk", "StreamDecoder", "AsyncClient", "AsyncStream", "Client", "Result", "Stream",
    "new_request_id",
]
