"""What the capabilities of one API server know about the model it serves (pure Python, no vLLM import).

One :class:`ServedModel` per API-server app: the integration layer creates it when it attaches the extension and
hands it to the capabilities that read it (the count route, the gateway's admission, the ledger's model labels);
``counting.server.init_state`` fills it at start-up, before any of them answers a request.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the calculator package is a pure core below every layer of the application
    from qwen_v3_calculator import Calculator


@dataclasses.dataclass
class ServedModel:
    name: str | None = None  # the first served model name (vLLM's default model)
    names: tuple[str, ...] = ()  # every served model name: the only model labels records and metrics carry
    calculator: Calculator | None = None  # for the served tokenizer and chat template
