"""A client that leaves a stream after a few chunks, and what its ledger record must then say (the ledger and the
monitoring modules both need a disconnected request).

On a machine short of CPU the test client itself can be starved: in CI (two xdist workers, later modules' servers
starting) a client that had its response headers read its first chunks only 17 s later, after the engine had generated
all of ``MAX_TOKENS``; the server had sent the chunks at once (its trace shows them leaving within 25 ms; ``ss`` showed
the unread bytes in the client's receive queue). Such a client leaves after the end, and "length" is then the right
record. A disconnect the server lost looks different: the client left early in the request's life, the request ran
on to the end. ``recorded`` tells the two apart; callers send another disconnect when the client was late.
"""
from __future__ import annotations

MAX_TOKENS = 4000  # the engine must not finish before a client that is not starved leaves
ATTEMPTS = 3  # disconnects tried before concluding that this machine never lets the client leave in time


def recorded(record, closed_at: float, max_tokens: int = MAX_TOKENS) -> bool:
    """``record``: the ledger record of a request whose client closed the connection at ``closed_at`` (wall clock)
    mid-stream. True if it says ``client_disconnected``; False if the engine finished the whole generation before the
    client got to leave. Fails if the disconnect was lost."""
    if record.status == "client_disconnected":
        return True
    assert record.status == "length" and record.completion_tokens == max_tokens, record
    left_after = closed_at - record.received_at
    assert left_after >= record.latency_s / 2, (
        f"disconnect lost: the client left {left_after:.2f} s after the request arrived, yet the request ran "
        f"{record.latency_s:.2f} s to the end", record)
    return False
