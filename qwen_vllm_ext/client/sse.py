"""Incremental Server-Sent Events parser (pure, no I/O) and the OpenAI stream decoder built on it.

``SSEParser.feed(bytes)`` accepts arbitrary byte slices — an event split at any byte, several events in one
read, CRLF / CR / LF line ends (a CR at the end of one read and the LF at the start of the next are one line
end), comments (``: keep-alive``), ``event:``/``id:``/``retry:`` fields, a UTF-8 BOM — and returns the events
completed so far. ``close()`` checks that the stream did not stop in the middle of an event.

``StreamDecoder`` turns events of an OpenAI-compatible stream into :class:`StreamChunk` objects: ``data: [DONE]``
ends the stream, an ``error`` object (or ``event: error``) mid-stream raises the typed exception of its code,
and the chunk keeps "empty delta" (``content == ""``) apart from "missing delta" (``content is None``).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from .errors import ClientError, IncompleteStreamError, SSEProtocolError, error_from_body

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEParser:
    """Bytes in, :class:`SSEEvent` out. Raises :class:`SSEProtocolError` on bytes that cannot be an SSE stream."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        self.max_event_bytes = max_event_bytes
        self._buf = bytearray()
        self._skip_lf = False  # the previous read ended with CR: a leading LF belongs to that line end
        self._first = True
        self._offset = 0  # bytes consumed so far (for error messages)
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._pending = 0  # bytes of the event being built
        self.last_event_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TypeError(f"SSEParser.feed takes bytes, not {type(chunk).__name__}")
        if not chunk:
            return []
        buf = self._buf
        buf += chunk
        if self._skip_lf and buf[:1] == b"\n":
            del buf[:1]
            self._offset += 1
        self._skip_lf = False
        if self._first:
            if len(buf) < 3 and b"\xef\xbb\xbf".startswith(bytes(buf)):
                return []
            if buf[:3] == b"\xef\xbb\xbf":
                del buf[:3]
                self._offset += 3
            self._first = False
        out: list[SSEEvent] = []
        start = 0
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf >= 0 else n)
            if cr >= 0:
                end, nxt = cr, cr + 1
                if nxt < n and buf[nxt] == 0x0A:
                    nxt += 1
                elif nxt == n:
                    self._skip_lf = True
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(bytes(buf[start:end]), self._offset + start)
            if event is not None:
                out.append(event)
            start = nxt
        del buf[:start]
        self._offset += start
        if len(buf) + self._pending > self.max_event_bytes:
            raise SSEProtocolError(f"an SSE event exceeds {self.max_event_bytes} bytes (at byte {self._offset}); "
                                   "the stream is not SSE or the limit (max_event_bytes) is too low")
        return out

    def _line(self, raw: bytes, at: int) -> SSEEvent | None:
        if not raw:  # blank line: dispatch
            if not self._data and not self._event:
                self._id_only_reset()
                return None
            event = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self.last_event_id,
                             retry=self._retry)
            self._data, self._event, self._retry, self._pending = [], "", None, 0
            return event
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEProtocolError(f"invalid UTF-8 in the SSE stream at byte {at + exc.start}: "
                                   f"{raw[max(0, exc.start - 8):exc.start + 8]!r}") from None
        self._pending += len(raw) + 1
        if line[0] == ":":
            return None  # comment
        name, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        elif line.lstrip().startswith(("{", "[")):
            raise SSEProtocolError(f"line at byte {at} is not an SSE field (JSON without a 'data:' prefix?): "
                                   f"{line[:60]!r}")
        # other field names are ignored, as the SSE specification says
        return None

    def _id_only_reset(self):
        self._retry = None
        self._pending = 0

    def close(self) -> None:
        """End of input: raise if the stream stopped inside an event (bytes or fields without the blank line)."""
        if self._buf or self._data or self._event:
            tail = bytes(self._buf[:60]) or ("data: " + "\n".join(self._data))[:60].encode()
            raise IncompleteStreamError(f"the stream ended in the middle of an SSE event at byte {self._offset} "
                                        f"({tail!r}…); the connection was probably cut")


@dataclasses.dataclass
class StreamChunk:
    """One decoded chunk of a chat/completions stream, with the time it was parsed (``time.perf_counter``)."""

    raw: dict
    received_at: float

    @property
    def id(self) -> str | None:
        return self.raw.get("id")

    @property
    def choices(self) -> list:
        return self.raw.get("choices") or []

    @property
    def usage(self) -> dict | None:
        u = self.raw.get("usage")
        return u if isinstance(u, dict) else None

    @property
    def is_usage_only(self) -> bool:
        return not self.choices and self.usage is not None

    def _choice(self, index: int) -> dict | None:
        for c in self.choices:
            if c.get("index", 0) == index:
                return c
        return None

    def content(self, index: int = 0) -> str | None:
        """Text of this chunk for choice ``index``: ``""`` for an empty delta, ``None`` when there is none."""
        c = self._choice(index)
        if c is None:
            return None
        if "delta" in c:
            d = c.get("delta")
            return d.get("content") if isinstance(d, dict) else None
        return c.get("text")  # /v1/completions

    @property
    def text(self) -> str | None:
        return self.content(0)

    def reasoning(self, index: int = 0) -> str | None:
        c = self._choice(index)
        d = (c or {}).get("delta")
        return d.get("reasoning_content", d.get("reasoning")) if isinstance(d, dict) else None

    def finish_reason(self, index: int = 0) -> str | None:
        return (self._choice(index) or {}).get("finish_reason")

    def token_ids(self, index: int = 0) -> list | None:
        c = self._choice(index) or {}
        return c.get("token_ids")


DONE = object()


class StreamDecoder:
    """Events of an OpenAI-compatible stream → :class:`StreamChunk` (or :data:`DONE`)."""

    def __init__(self, status_code: int = 200, headers: Any = None, require_done: bool = True,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        self.parser = SSEParser(max_event_bytes)
        self.status_code = status_code
        self.headers = headers or {}
        self.require_done = require_done
        self.done = False
        self.events = 0
        self._error: BaseException | None = None  # raised after the chunks that came before it

    def feed(self, data: bytes, now: float | None = None) -> list[StreamChunk]:
        """Chunks completed by ``data``. An error (event or malformed data) is raised once the chunks received
        before it have been returned: at the next ``feed`` or at ``close``."""
        if self._error is not None:
            raise self._error
        now = time.perf_counter() if now is None else now
        out = []
        try:
            for ev in self.parser.feed(data):
                chunk = self.decode(ev, now)
                if chunk is not None:
                    out.append(chunk)
        except ClientError as exc:
            if not out:
                raise
            self._error = exc
        return out

    def decode(self, ev: SSEEvent, now: float) -> StreamChunk | None:
        self.events += 1
        if self.done:
            if ev.data.strip():
                raise SSEProtocolError(f"data after [DONE]: {ev.data[:60]!r}")
            return None
        if ev.data == "[DONE]":
            self.done = True
            return None
        if ev.data == "" and ev.event == "message":
            return None
        try:
            body = json.loads(ev.data)
        except ValueError as exc:
            raise SSEProtocolError(f"event {self.events} carries data that is not JSON ({exc}): {ev.data[:80]!r}") \
                from None
        if ev.event == "error" or (isinstance(body, dict) and "error" in body and "choices" not in body):
            raise error_from_body(self.status_code, body, self.headers, mid_stream=True)
        if not isinstance(body, dict):
            raise SSEProtocolError(f"event {self.events} is JSON but not an object: {ev.data[:80]!r}")
        return StreamChunk(body, now)

    def close(self) -> None:
        if self._error is not None:
            raise self._error
        self.parser.close()
        if self.require_done and not self.done:
            raise IncompleteStreamError("the stream ended without 'data: [DONE]' (the server or the connection "
                                        "stopped early)")
