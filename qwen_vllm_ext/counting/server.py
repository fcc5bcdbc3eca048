"""``POST /v1/tokens/count``: the calculator as a service for gateways written in other languages.

Body: OpenAI-style, either ``messages`` (+ optional ``tools``, ``chat_template_kwargs``) or ``prompt``;
optional ``completion`` (output text to bill) and ``cached_tokens``. Response: the same dict as
``qwen_v3_calculator.calculate_tokens`` (billed units as exact decimal strings), plus ``model``.
The calculator uses the served model's own ``tokenizer.json`` when the model is a local directory that has
one (a fine-tune with added tokens is counted with its own vocabulary), else the bundled vocabulary of the model's
family (Qwen3.5/3.6 ids such as ``Qwen/Qwen3.6-27B``: the Qwen3.6 one; others: Qwen3's).
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation.
import json
import os

from ..common.errors import error_response

COUNT_PATH = "/v1/tokens/count"


def init_state(served, args) -> None:
    """Fill the server's :class:`~qwen_vllm_ext.common.served.ServedModel` (first at start-up: the gateway's
    admission counts with its calculator): the served names, and the calculator for the served tokenizer and the
    template vLLM serves (the package's prefix-stable one in KV-reuse mode, else the tokenizer's)."""
    from ..kv.reuse import served_template

    names = getattr(args, "served_model_name", None) or [args.model]
    names = list(names) if isinstance(names, (list, tuple)) else [names]
    served.name, served.names = names[0], tuple(names)
    served.calculator = calculator_for_model(args.model, getattr(args, "tokenizer", None),
                                             template=served_template(args))


def calculator_for_model(model: str | None, tokenizer: str | None = None, template: str | None = None):
    from qwen_v3_calculator import Calculator

    from ..common.family import detect

    for candidate in (tokenizer, model):
        if candidate and os.path.isfile(os.path.join(os.path.expanduser(candidate), "tokenizer.json")):
            return Calculator(tokenizer=os.path.expanduser(candidate), template=template)
    vocabulary = detect(tokenizer or model or "").vocabulary if (tokenizer or model) else None
    return Calculator(model="qwen3.6" if vocabulary == "qwen3.6" else None, template=template)


def router(served):
    """The route (the integration layer includes the router); it counts with ``served`` (a
    :class:`~qwen_vllm_ext.common.served.ServedModel`), which ``init_state`` fills."""
    from fastapi import APIRouter, Request

    app = APIRouter()

    @app.post(COUNT_PATH)
    async def count_tokens(request: Request):
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request")
        messages, prompt = body.get("messages"), body.get("prompt")
        if (messages is None) == (prompt is None):
            return error_response(400, "send exactly one of 'messages' (chat) or 'prompt' (text)", "missing_input",
                                  param="messages")
        completion = body.get("completion", "")
        cached = body.get("cached_tokens", 0)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            calc = served.calculator
            if messages is not None:
                result = calc.calculate_tokens(output_text=completion, messages=messages, cached_tokens=cached,
                                               tools=body.get("tools"), **kwargs)
            else:
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt must be str, not {type(prompt).__name__}")
                result = calc.calculate_tokens(input_text=prompt, output_text=completion, cached_tokens=cached)
        except (TypeError, ValueError) as exc:
            return error_response(400, str(exc), "invalid_request",
                                  param="messages" if messages is not None else "prompt")
        from qwen_v3_calculator.calculator import to_jsonable

        return {"model": body.get("model") or served.name, **to_jsonable(result)}

    return app
