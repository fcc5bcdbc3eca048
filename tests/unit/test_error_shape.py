"""One error shape on every route (common/errors.py): vLLM's and Starlette's error bodies normalized, the
extension's own left as they are, through the real ASGI middleware on a Starlette app."""
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from qwen_vllm_ext.common.errors import TYPES, ErrorShapeMiddleware, error_body, normalize


def shape_ok(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("type") in TYPES
            and isinstance(err.get("code"), str) and err["code"] and (err.get("param") is None
                                                                        or isinstance(err["param"], str)))


@pytest.mark.parametrize("status, body, code, type_", [
    # vLLM 0.32: the exception class as type, the HTTP status as a number
    (404, {"error": {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}}, "model_not_found", "invalid_request_error"),
    (400, {"error": {"message": "This model's maximum context length is 4096 tokens. However, you requested 5000 "
                                "tokens (9 in the messages, 4991 in the completion).", "type": "BadRequestError",
                     "param": None, "code": 400}}, "context_length_exceeded", "invalid_request_error"),
    (400, {"error": {"message": "bad", "type": "InvalidUserInput", "param": None, "code": 400}}, "invalid_value",
     "invalid_request_error"),
    (500, {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}},
     "internal_error", "server_error"),
    (501, {"error": {"message": "no", "type": "NotImplementedError", "code": 501}}, "not_implemented",
     "server_error"),
    # Starlette / FastAPI
    (404, {"detail": "Not Found"}, "not_found", "invalid_request_error"),
    (405, {"detail": "Method Not Allowed"}, "method_not_allowed", "invalid_request_error"),
    (422, {"detail": [{"loc": ["body", "x"], "msg": "field required"}]}, "invalid_request", "invalid_request_error"),
    (503, None, "service_unavailable", "server_error"),
    (401, {"error": {"message": "x", "type": "weird", "code": None}}, "invalid_api_key", "authentication_error"),
    (403, {"detail": "Forbidden"}, "permission_denied", "permission_error"),
])
def test_vllm_and_starlette_errors_get_the_one_shape(status, body, code, type_):
    fixed = normalize(status, body)
    assert shape_ok(fixed) and (fixed["error"]["code"], fixed["error"]["type"]) == (code, type_), fixed
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        assert fixed["error"]["message"] == body["error"]["message"]
    assert normalize(status, fixed) is None  # idempotent


def test_anthropic_errors_keep_their_top_level_type():
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}}
    fixed = normalize(400, body)
    assert fixed["type"] == "error" and shape_ok(fixed) and fixed["error"]["code"] == "invalid_request"


def test_the_extensions_own_errors_are_left_alone():
    for body in (error_body("no key", "invalid_api_key", "authentication_error"),
                 error_body("slow down", "rate_limit_exceeded", "tokens"),
                 error_body("bad", "unknown_parameter", param="frobnicate")):
        assert normalize(400, body) is None


def _app():
    async def vllm_error(request):
        return JSONResponse({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                       "param": "model", "code": 404}}, status_code=404)

    async def fine(request):
        return JSONResponse({"ok": True})

    async def text_error(request):
        return PlainTextResponse("Internal Server Error", status_code=500)

    async def stream(request):
        async def gen():
            yield b"data: {}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/vllm", vllm_error), Route("/fine", fine), Route("/text", text_error),
                            Route("/stream", stream)])
    app.add_middleware(ErrorShapeMiddleware)
    return app


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_middleware_rewrites_errors_only(anyio_backend):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://t") as c:
        r = await c.get("/vllm")
        assert r.status_code == 404 and shape_ok(r.json()) and r.json()["error"]["code"] == "model_not_found"
        assert int(r.headers["content-length"]) == len(r.content)
        r = await c.get("/nowhere")  # Starlette's own 404 (text/plain; FastAPI's is {"detail": ...})
        assert r.status_code == 404 and shape_ok(r.json()) and r.json()["error"]["code"] == "not_found"
        assert r.json()["error"]["message"] == "Not Found"
        r = await c.post("/fine")  # 405
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        r = await c.get("/text")  # a text/plain error: its text becomes the message
        assert r.status_code == 500 and shape_ok(r.json()) and r.json()["error"]["message"] == "Internal Server Error"
        r = await c.get("/fine")
        assert r.json() == {"ok": True}
        r = await c.get("/stream")
        assert r.text == "data: {}\n\n"


def test_an_error_event_in_a_stream_gets_the_shape():
    from qwen_vllm_ext.usage.stream_usage import rewrite_sse

    event = "data: " + json.dumps({"error": {"message": "engine died", "type": "InternalServerError",
                                             "param": None, "code": 500}}) + "\n\n"
    out = json.loads(rewrite_sse(event, None, None)[6:])
    assert shape_ok(out) and out["error"]["code"] == "internal_error" and out["error"]["type"] == "server_error"
