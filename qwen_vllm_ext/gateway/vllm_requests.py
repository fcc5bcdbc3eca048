"""Glue: the gateway's only touch of vLLM -- its request models and its Anthropic endpoint's converter.

* :func:`request_fields` -- the field names of the installed vLLM's ``ChatCompletionRequest``,
  ``CompletionRequest`` and ``AnthropicMessagesRequest`` (admission refuses a field its table does not classify).
* :func:`to_chat_body` -- a ``/v1/messages`` body as the chat request vLLM itself converts it to, so admission
  counts exactly what the engine will render. vLLM 0.32 serves ``/v1/messages`` by converting the Anthropic
  request with ``AnthropicServingMessages.to_chat_completion_request`` and running the chat path on the result.
  The conversion depends on two things the serving object decided at startup: whether inline system messages
  are merged into the leading one (``_merge_inline_system``, probed from the chat template) and which
  ``reasoning_effort`` ``thinking: {"type": "disabled"}`` maps to (``_get_disabled_thinking_effort``, probed once
  by rendering). Both are read from the live serving object on ``app.state``.
* :func:`check_request` -- an admitted body validated by vLLM's own request model: vLLM's refusals, and the shapes
  that crash its validators, become 400s before anything is reserved.
* :func:`queued_tokens` -- the engine client's ``get_num_queued_tokens`` (prompt tokens of this API server's requests
  that have not produced their first output): the backlog of capacity 429s.
"""
from __future__ import annotations

from .admission import Rejection

SERVING_STATE = "anthropic_serving_messages"  # app.state attribute vLLM's api_router reads
TARGETS = ("vllm.entrypoints.anthropic.serving.AnthropicServingMessages.to_chat_completion_request",
           "vllm.entrypoints.anthropic.serving.AnthropicServingMessages._get_disabled_thinking_effort",
           "vllm.entrypoints.anthropic.serving.AnthropicServingMessages._merge_inline_system",
           "vllm.v1.engine.async_llm.AsyncLLM.get_num_queued_tokens")


def check_request(body: dict, kind: str) -> None:
    """Validate an admitted body with the installed vLLM's own request model (``ChatCompletionRequest`` /
    ``CompletionRequest``), as vLLM will once the gateway forwards it: what vLLM refuses is a 400 here, and what would
    crash vLLM's validation (a non-object ``structured_outputs`` raised ``AttributeError`` in a before-validator of
    0.32: a 500, or a dropped connection) is a 400 too, before any reservation. ~25 us per request."""
    from pydantic import ValidationError

    model = _request_models()[kind]
    try:
        model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise Rejection(400, "invalid_request_error", f"invalid request: {where}: {first.get('msg')}",
                        param=where) from None
    except Exception as exc:  # noqa: BLE001 -- vLLM's validators fail on shapes they do not expect
        raise Rejection(400, "invalid_request_error", f"invalid request: vLLM cannot read it ({type(exc).__name__}: "
                        f"{exc}); check the types of its fields against the API reference") from None


def _request_models() -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"chat": ChatCompletionRequest, "completion": CompletionRequest}


def queued_tokens(engine_client):
    """A zero-argument reader of the engine's backlog in prompt tokens."""
    return engine_client.get_num_queued_tokens


def request_fields() -> dict[str, frozenset]:
    """Field names of the installed vLLM's request models, by admission kind."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"chat": frozenset(ChatCompletionRequest.model_fields),
            "completion": frozenset(CompletionRequest.model_fields),
            "messages": frozenset(AnthropicMessagesRequest.model_fields)}


async def to_chat_body(body: dict, app_state) -> dict:
    """The chat request body vLLM will run for this Anthropic Messages body (a 400 when vLLM would refuse it)."""
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    serving = getattr(app_state, SERVING_STATE, None)
    if serving is None:
        raise Rejection(404, "endpoint_not_found", "/v1/messages is not served by this model")
    try:
        request = AnthropicMessagesRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise Rejection(400, "invalid_request_error", f"invalid Messages request: {where}: {first.get('msg')}",
                        param=where) from None
    effort = "none"
    if request.thinking is not None and request.thinking.type == "disabled":
        effort = await serving._get_disabled_thinking_effort()
    try:
        chat = serving.to_chat_completion_request(request, merge_inline_system=serving._merge_inline_system,
                                                  disabled_thinking_effort=effort)
    except (ValueError, TypeError) as exc:
        raise Rejection(400, "invalid_request_error", f"invalid Messages request: {exc}") from None
    return chat.model_dump(mode="json", exclude_unset=True)
