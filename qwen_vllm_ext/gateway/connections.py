"""The API server's connection limits (pure: no asyncio, no uvicorn, no vLLM; the glue is ``vllm_connections.py``).

Three rules keep idle or half-open connections from taking the server down:

* **header timeout** — a connection must send a complete request head (request line and headers) within
  ``header_timeout_s`` of opening, and within ``header_timeout_s`` of its first byte after a response on a
  kept-alive connection; otherwise it gets ``408`` and is closed. uvicorn has no such timer: its keep-alive timer
  starts only after a response, and the ASGI app is called only once the headers are complete, so a connection
  that never sends a byte (or trickles one a minute) used to stay open for ever.
* **connection cap** — at most ``cap`` open HTTP connections per API-server process, below the open-file limit
  (``fd limit - reserve``), so the process keeps descriptors for its own work (engine sockets, files, the ledger).
  A connection over the cap first makes room by closing the **oldest connection still waiting for its request
  head** (older than ``EVICT_MIN_AGE_S``: a client that connected a moment ago is never the one dropped); when
  every open connection is busy with a request, the new one gets ``503`` with ``Retry-After`` and is closed. A
  flood of idle connections therefore recycles itself instead of locking everyone out: health checks and real
  requests still get in.
* **open-file limit** — the soft ``RLIMIT_NOFILE`` is raised to the hard limit at start.

Everything here is decisions and bookkeeping over plain values and opaque connection objects, tested in
milliseconds (``tests/unit/test_connections.py``).
"""
from __future__ import annotations

import dataclasses
import json

EVICT_MIN_AGE_S = 1.0
"""A connection waiting for its request head is evicted for a newcomer only once it is at least this old."""
REFUSAL_LINGER_S = 2.0
"""A refused connection is read (and discarded) for at most this long after its 503, so the client reads the
answer instead of a reset (closing a socket with unread input sends RST, which can drop the 503)."""
MIN_CAP = 64
"""The cap never goes below this (a tiny open-file limit still serves a few clients)."""
UNLIMITED_FD_CAP = 65536
"""The derived cap when the open-file limit is unlimited or unknown."""


class ConnectionSettingsError(ValueError):
    """A connection setting has a value that cannot work; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """What one API-server process enforces, and why."""

    header_timeout_s: float  # 0: no header timeout
    cap: int  # 0: no cap
    fd_limit: int | None  # the soft open-file limit the cap was derived from (None: unlimited/unknown)
    reserve: int
    refusal_slots: int  # refused connections lingering at once; more are reset at once
    how: str  # one line: how the cap was chosen

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fd_limit_target(soft: int, hard: int, infinity: int, nr_open: int | None = None) -> int | None:
    """The soft ``RLIMIT_NOFILE`` to set so the process may use every descriptor it is allowed: the hard limit
    (``nr_open``, the kernel's ceiling, where the hard limit is unlimited). None: nothing to raise."""
    target = hard
    if hard == infinity:
        if not nr_open:
            return None
        target = nr_open
    if soft != infinity and soft < target:
        return target
    return None


def refusal_slots(reserve: int) -> int:
    """Refused connections allowed to linger at once (they use descriptors of the reserve): a quarter of it,
    between 16 and 256."""
    return max(16, min(256, reserve // 4))


def connection_limits(header_timeout_s: float, max_connections: int, fd_reserve: int, fd_limit: int | None,
                      ) -> ConnectionLimits:
    """The limits for these settings and the process's soft open-file limit (None: unlimited or unknown).

    ``max_connections`` 0 derives the cap: ``fd_limit - fd_reserve``, but never less than half the limit (a reserve
    larger than the limit leaves half of it to connections) nor less than ``MIN_CAP``. A configured cap above
    what the open-file limit allows is lowered to it (the ``how`` line says so)."""
    for name, value in (("header_timeout_s", header_timeout_s), ("max_connections", max_connections),
                        ("connection_fd_reserve", fd_reserve)):
        if value < 0:
            raise ConnectionSettingsError(f"setting {name!r} must be >= 0, got {value}")
    if fd_limit is None:
        allowed, basis = UNLIMITED_FD_CAP, "no open-file limit"
    else:
        allowed = max(MIN_CAP, fd_limit - fd_reserve, fd_limit // 2)
        if allowed == fd_limit - fd_reserve:
            basis = f"open-file limit {fd_limit} - reserve {fd_reserve}"
        elif allowed == fd_limit // 2:
            basis = f"half the open-file limit {fd_limit} (reserve {fd_reserve} is more than half)"
        else:
            basis = f"the minimum {MIN_CAP} (open-file limit {fd_limit})"
    if max_connections == 0:
        cap, how = allowed, f"derived: {basis}"
    elif max_connections > allowed and fd_limit is not None:
        cap, how = allowed, f"max_connections {max_connections} lowered to {allowed} ({basis})"
    else:
        cap, how = max_connections, "max_connections"
    return ConnectionLimits(float(header_timeout_s), int(cap), fd_limit, int(fd_reserve), refusal_slots(fd_reserve),
                            how)


ADMIT, EVICT, REFUSE, RESET = "admit", "evict", "refuse", "reset"


@dataclasses.dataclass
class ConnectionStats:
    """Counters of one server (reported on the health route)."""

    accepted: int = 0
    header_timeouts: int = 0
    evicted: int = 0
    refused: int = 0  # answered 503
    reset: int = 0  # over the cap with every refusal slot taken: closed without an answer

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConnectionTable:
    """The connections of one server that are waiting for a request head, oldest first, and the admission rule.

    Connections are opaque objects (the glue's protocol instances); times come from the caller's clock."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.stats = ConnectionStats()
        self._waiting: dict[object, float] = {}  # insertion order = the order they started waiting
        self.lingering = 0  # refused connections still being read before close

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, conn: object, now: float) -> None:
        """``conn`` now waits for a request head (opened, or a byte arrived after a response); re-adding moves it to
        the young end."""
        self._waiting.pop(conn, None)
        self._waiting[conn] = now

    def done(self, conn: object) -> None:
        """``conn`` sent its request head, or closed."""
        self._waiting.pop(conn, None)

    def is_waiting(self, conn: object) -> bool:
        return conn in self._waiting

    def oldest_waiting(self, now: float) -> object | None:
        """The connection that has waited longest, if it has waited at least ``EVICT_MIN_AGE_S``."""
        for conn, since in self._waiting.items():
            return conn if now - since >= EVICT_MIN_AGE_S else None
        return None

    def admit(self, open_connections: int, now: float) -> tuple[str, object | None]:
        """What to do with a new connection while ``open_connections`` are open (the new one not counted):

        ``(ADMIT, None)``, ``(EVICT, victim)`` (close the victim — removed from the table here — and admit),
        ``(REFUSE, None)`` (answer 503 and linger; the caller calls :meth:`refusal_closed` when it is gone) or
        ``(RESET, None)`` (close at once: every refusal slot is taken)."""
        cap = self.limits.cap
        if not cap or open_connections < cap:
            self.stats.accepted += 1
            return ADMIT, None
        victim = self.oldest_waiting(now)
        if victim is not None:
            self.done(victim)
            self.stats.evicted += 1
            self.stats.accepted += 1
            return EVICT, victim
        if self.lingering < self.limits.refusal_slots:
            self.lingering += 1
            self.stats.refused += 1
            return REFUSE, None
        self.stats.reset += 1
        return RESET, None

    def refusal_closed(self) -> None:
        self.lingering = max(0, self.lingering - 1)

    def timed_out(self, conn: object) -> None:
        self.done(conn)
        self.stats.header_timeouts += 1

    def status(self, open_connections: int) -> dict:
        return {**self.limits.as_dict(), "open": open_connections, "waiting_for_headers": len(self._waiting),
                **self.stats.as_dict()}


def timer_should_close(armed_cycle: object, current_cycle: object, cycle_done: bool, closing: bool) -> bool:
    """Whether a header timer that fires closes its connection: only if no request started since it was armed
    (the connection's request cycle is the same object) and none is running; a connection busy with a request (a
    long stream) is never closed by it."""
    return not closing and current_cycle is armed_cycle and (current_cycle is None or cycle_done)


def _response(status: int, reason: str, message: str, code: str, type_: str, extra: tuple[str, ...] = ()) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def header_timeout_response(timeout_s: float) -> bytes:
    return _response(408, "Request Timeout",
                     f"no complete request head (request line and headers) within {timeout_s:g} s; send the request "
                     "as soon as the connection is open", "request_header_timeout", "timeout_error")


def evicted_response() -> bytes:
    return _response(408, "Request Timeout",
                     "this connection was idle (no request head) while the server was at its connection limit; "
                     "reconnect and send the request at once", "idle_connection_closed", "timeout_error")


def refusal_response(cap: int) -> bytes:
    return _response(503, "Service Unavailable",
                     f"the server is at its connection limit ({cap} open connections, all busy with requests); retry "
                     "after the Retry-After delay", "too_many_connections", "server_overloaded", ("retry-after: 1",))
