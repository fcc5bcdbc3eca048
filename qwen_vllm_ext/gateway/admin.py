"""Admin HTTP endpoints for API keys, guarded by the ``admin_key`` setting (constant-time comparison).

    POST   /qwen_ext/admin/keys            {"name": ..., "models": [...], "rpm": ..., ...} -> key + secret (once)
    GET    /qwen_ext/admin/keys            list (no secrets)
    GET    /qwen_ext/admin/keys/{key_id}
    PATCH  /qwen_ext/admin/keys/{key_id}   fields to change
    DELETE /qwen_ext/admin/keys/{key_id}   revoke

Budgets are given in billed units (``daily_budget``, ``monthly_budget``; decimals allowed) or micro-units.
With ``admin_key`` empty every admin route answers 404.
"""
# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation.
import asyncio
import json

from ..common.errors import error_response
from ..keys import KeyNotFound, parse_billed, parse_expiry
from .middleware import check_admin

PREFIX = "/qwen_ext/admin/keys"


def _scope_fields(body: dict) -> dict:
    fields = dict(body)
    for unit, micro in (("daily_budget", "daily_budget_micro"), ("monthly_budget", "monthly_budget_micro")):
        if unit in fields:
            value = fields.pop(unit)
            fields[micro] = None if value is None else parse_billed(value)
    if fields.get("expires_at") is not None:
        fields["expires_at"] = parse_expiry(fields["expires_at"])
    return fields


def router(key_store, admin_key: str):
    """The ``/qwen_ext/admin/keys`` routes (the integration layer includes the router)."""
    from fastapi import APIRouter, Request

    app = APIRouter()

    async def guarded(request: Request, work):
        if not admin_key:
            return error_response(404, "admin endpoints are disabled (set the admin_key setting)", "not_found")
        if not check_admin(request.scope, admin_key):
            return error_response(401, "admin endpoints need 'Authorization: Bearer <admin_key>'",
                                  "invalid_admin_key", type_="authentication_error")
        try:
            return await work()
        except KeyNotFound as exc:
            return error_response(404, str(exc), "key_not_found")
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), "invalid_request_error")

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise ValueError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        return body

    @app.post(PREFIX)
    async def create_key(request: Request):
        async def work():
            fields = _scope_fields(await body_of(request))
            name = fields.pop("name", None)
            if not isinstance(name, str) or not name:
                raise ValueError("'name' is required")
            secret, key = await asyncio.to_thread(key_store.create, name, **fields)
            return {"key": secret, "warning": "store this key now: it is not kept and cannot be shown again",
                    **key.to_public_dict()}
        return await guarded(request, work)

    @app.get(PREFIX)
    async def list_keys(request: Request):
        async def work():
            keys = await asyncio.to_thread(key_store.list, request.query_params.get("include_revoked") == "true")
            return {"data": [k.to_public_dict() for k in keys]}
        return await guarded(request, work)

    @app.get(PREFIX + "/{key_id}")
    async def show_key(request: Request, key_id: str):
        async def work():
            key = await asyncio.to_thread(key_store.get, key_id)
            if key is None:
                raise KeyNotFound(key_id)
            return key.to_public_dict()
        return await guarded(request, work)

    @app.patch(PREFIX + "/{key_id}")
    async def update_key(request: Request, key_id: str):
        async def work():
            fields = _scope_fields(await body_of(request))
            return (await asyncio.to_thread(key_store.update, key_id, **fields)).to_public_dict()
        return await guarded(request, work)

    @app.delete(PREFIX + "/{key_id}")
    async def revoke_key(request: Request, key_id: str):
        async def work():
            return (await asyncio.to_thread(key_store.revoke, key_id)).to_public_dict()
        return await guarded(request, work)

    return app
