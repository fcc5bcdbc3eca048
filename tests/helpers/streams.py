"""Streamed responses read as token ids (requests with ``return_token_ids``)."""
import json

END_THINK = 248069  # ``</think>`` in the Qwen3.5/3.6 vocabulary: the reasoning tokens are the ones before it


def stream_then_drop(c, path: str, body: dict, after: int, headers: dict) -> list[int]:
    """Token ids a client gets from a streamed request (``body`` asks for ``return_token_ids``) before it drops the
    connection, once it has ``after`` of them."""
    received: list[int] = []
    with c.stream("POST", path, json=body, headers=headers) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    received += ch.get("token_ids") or []
            if len(received) >= after:
                break  # leaving the block closes the connection mid-answer
    return received
