"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "param", "code"}}`` with a string ``code``."""
from __future__ import annotations


def error_body(message: str, code: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, type_: str = "invalid_request_error",
                   param: str | None = None, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(message, code, type_, param), status_code=status, headers=headers)
