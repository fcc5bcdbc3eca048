"""One error shape on every route: ``{"error": {"message", "type", "param", "code"}}`` with a string ``code`` and a
``type`` from :data:`TYPES`.

The extension's own errors are built here (:func:`error_body`, :func:`error_response`). vLLM's are not: 0.32 answers
``{"error": {"type": "BadRequestError", "code": 400, ...}}`` (the exception class as the type, the HTTP status as a
number), and Starlette ``{"detail": "Not Found"}`` for an unknown route. :func:`normalize` maps every such body to
the one shape (docs/gateway.md has the table), and :class:`ErrorShapeMiddleware` applies it to every error response
of the API server (pure ASGI: it reads only responses with status >= 400 and a JSON or text body); the SSE layer applies it
to an error event inside a stream (``usage/stream_usage.rewrite_sse``).
"""
from __future__ import annotations

import json

TYPES = ("invalid_request_error", "authentication_error", "permission_error", "requests", "tokens",
         "insufficient_quota", "server_error")
"""Every ``type`` an error may have (OpenAI's vocabulary: ``requests``/``tokens`` for rate limits)."""

_STATUS_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                 415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limit_exceeded",
                 500: "internal_error", 501: "not_implemented", 502: "bad_gateway", 503: "service_unavailable",
                 504: "timeout"}


def error_body(message: str, code: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, type_: str = "invalid_request_error",
                   param: str | None = None, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(message, code, type_, param), status_code=status, headers=headers)


def type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


def code_for(status: int, message: str, vllm_type: str | None = None) -> str:
    """A string code for an error that has none (or vLLM's numeric one), from its status and message."""
    text = message.lower()
    if status == 400 and ("maximum context length" in text or "context length" in text and "token" in text):
        return "context_length_exceeded"  # OpenAI's code for a prompt + max_tokens over the context
    if status == 404 and "model" in text and ("does not exist" in text or "not found" in text):
        return "model_not_found"
    if status == 400 and vllm_type == "InvalidUserInput":
        return "invalid_value"
    return _STATUS_CODES.get(status, "server_error" if status >= 500 else "invalid_request")


def normalize(status: int, body) -> dict | None:
    """``body`` (a parsed JSON error body) in the one shape, or None when it already is. A body that is not an error
    (no ``error`` and no ``detail``) gets one built from the status."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = err.get("message")
        message = message if isinstance(message, str) else json.dumps(message)
        code, type_, param = err.get("code"), err.get("type"), err.get("param")
        if isinstance(code, str) and code and type_ in TYPES and (param is None or isinstance(param, str)) \
                and isinstance(err.get("message"), str):
            return None
        vllm_type = type_ if isinstance(type_, str) else None
        fixed = error_body(message, code if isinstance(code, str) and code else code_for(status, message, vllm_type),
                           type_ if type_ in TYPES else type_for(status), param if isinstance(param, str) else None)
        return {**body, **fixed}  # other top-level keys stay (Anthropic's "type": "error" on /v1/messages)
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        message = detail
    elif detail is not None:  # FastAPI's validation errors: a list of {loc, msg, type}
        message = "invalid request: " + json.dumps(detail, ensure_ascii=False)[:2000]
    else:
        message = f"HTTP {status}"
    return error_body(message, code_for(status, message), type_for(status))


class ErrorShapeMiddleware:
    """Pure ASGI: every HTTP response with status >= 400 and a JSON or plain-text body leaves in the one error shape
    (a text body becomes the message; the body is buffered only for such responses: errors are small); everything
    else -- successes, streams, HTML -- passes through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict = {}

        async def wrapped_send(message):
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                if message["status"] >= 400 and (ctype.startswith((b"application/json", b"text/plain")) or not ctype):
                    held["start"], held["body"] = message, bytearray()
                    return
                return await send(message)
            if message["type"] == "http.response.body" and "start" in held:
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                start = held.pop("start")
                body = bytes(held["body"])
                try:
                    fixed = normalize(start["status"], json.loads(body) if body else None)
                except ValueError:
                    fixed = normalize(start["status"], {"detail": body.decode("utf-8", "replace")[:2000]})
                if fixed is not None:
                    body = json.dumps(fixed, ensure_ascii=False).encode()
                    headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() not in
                               (b"content-length", b"content-type")]
                    start = {**start, "headers": headers + [(b"content-type", b"application/json"),
                                                            (b"content-length", str(len(body)).encode())]}
                await send(start)
                return await send({"type": "http.response.body", "body": body})
            return await send(message)

        await self.app(scope, receive, wrapped_send)
