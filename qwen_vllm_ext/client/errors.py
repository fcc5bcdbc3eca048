"""Typed exceptions of the client SDK, mapped from HTTP status and the OpenAI-shaped error ``code``.

Every API error carries ``status_code``, ``code``, ``type``, ``param``, ``message``, the response ``headers``
and the ``request_id`` (``x-request-id``). :func:`error_from_response` picks the class: the ``code`` decides
first (``insufficient_quota`` is never a plain rate limit), then the status.
"""
from __future__ import annotations

import json
from typing import Any


class ClientError(Exception):
    """Base of every exception the SDK raises."""


class SSEProtocolError(ClientError):
    """The bytes received are not a well-formed SSE / OpenAI stream."""


class IncompleteStreamError(SSEProtocolError):
    """The stream stopped before its end (inside an event, or without ``data: [DONE]``)."""


class APIConnectionError(ClientError):
    """The server could not be reached or the connection broke before a response arrived."""


class APITimeoutError(APIConnectionError):
    pass


class APIError(ClientError):
    """An error response (or an error event in a stream)."""

    def __init__(self, message: str, status_code: int, code: str | None = None, type_: str | None = None,
                 param: str | None = None, headers: Any = None, body: Any = None, mid_stream: bool = False):
        super().__init__(f"{status_code} {code or type_ or 'error'}: {message}")
        self.message = message
        self.status_code = status_code
        self.code = code
        self.type = type_
        self.param = param
        self.headers = {k.lower(): v for k, v in dict(headers or {}).items()}
        self.body = body
        self.mid_stream = mid_stream

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    @property
    def retry_after(self) -> str | None:
        return self.headers.get("retry-after")


class BadRequestError(APIError):  # 400
    pass


class ContextLengthExceededError(BadRequestError):
    pass


class AuthenticationError(APIError):  # 401
    pass


class PermissionDeniedError(APIError):  # 403
    pass


class NotFoundError(APIError):  # 404
    pass


class RequestTooLargeError(APIError):  # 413
    pass


class RateLimitError(APIError):  # 429 rate_limit_exceeded: waiting helps
    pass


class InsufficientQuotaError(APIError):  # 429 insufficient_quota: waiting does not help; never retried
    pass


class ServerError(APIError):  # 5xx
    pass


class ServiceUnavailableError(ServerError):  # 503
    pass


class StreamError(APIError):
    """An ``error`` event received after the stream had started (the status line said 200)."""


BY_CODE: dict[str, type[APIError]] = {
    "insufficient_quota": InsufficientQuotaError,
    "rate_limit_exceeded": RateLimitError,
    "context_length_exceeded": ContextLengthExceededError,
    "invalid_api_key": AuthenticationError,
    "api_key_expired": AuthenticationError,
    "api_key_suspended": PermissionDeniedError,
    "model_not_allowed": PermissionDeniedError,
    "endpoint_not_allowed": PermissionDeniedError,
    "request_too_large": RequestTooLargeError,
    "service_unavailable": ServiceUnavailableError,
}
BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    413: RequestTooLargeError, 422: BadRequestError, 429: RateLimitError, 503: ServiceUnavailableError,
}


def error_class(status_code: int, code: str | None) -> type[APIError]:
    if code in BY_CODE:
        return BY_CODE[code]
    if status_code in BY_STATUS:
        return BY_STATUS[status_code]
    if status_code >= 500:
        return ServerError
    return APIError


def error_from_body(status_code: int, body: Any, headers: Any = None, mid_stream: bool = False) -> APIError:
    """The exception for a decoded error body (OpenAI shape, or anything else a server sent)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        code = err.get("code")
        code = str(code) if code is not None else None
        type_, param = err.get("type"), err.get("param")
    else:
        message = (err if isinstance(err, str) else None) or (body.get("message") if isinstance(body, dict) else None) \
            or (json.dumps(body)[:500] if body is not None else "")
        code = type_ = param = None
    # vLLM puts the HTTP status into "code" as an int on some errors; mid-stream errors come with status 200
    if isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] >= 400:
        status_code = err["code"] if mid_stream or status_code < 400 else status_code
        code = None
    cls = StreamError if mid_stream and code not in BY_CODE else error_class(status_code, code)
    return cls(message or f"HTTP {status_code}", status_code, code, type_, param, headers, body, mid_stream)


def error_from_response(status_code: int, content: bytes, headers: Any = None) -> APIError:
    try:
        body = json.loads(content.decode("utf-8")) if content else None
    except (UnicodeDecodeError, ValueError):
        body = {"error": {"message": content[:500].decode("utf-8", "replace") or f"HTTP {status_code}"}}
    return error_from_body(status_code, body, headers)
