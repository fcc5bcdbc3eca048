"""The only glue of the connection limits (``connections.py`` decides; this applies it to vLLM's uvicorn server).

vLLM 0.32/0.33 serve HTTP through ``vllm.entrypoints.launchers.launcher.serve_http``, which builds a loaded
``uvicorn.Config`` and passes it to ``NoSignalServer(config, peer_loads=...)``; both ways that server accepts a
connection (uvicorn's own asyncio server, and ``NoSignalServer._connect`` with several API-server processes) build
the protocol from ``config.http_protocol_class``. :func:`install` wraps ``NoSignalServer.__init__`` to replace that
class with :func:`guarded_protocol` of it: uvicorn's own HTTP protocol (httptools or h11) with a header timer and
the connection cap. It also raises the process's open-file limit (``RLIMIT_NOFILE`` soft -> hard).

uvicorn is not fingerprinted by the guard (it is not vLLM): :func:`guarded_protocol` wraps only uvicorn's two
HTTP/1.1 protocols and relies on their ``cycle`` attribute (the current request; a new object per request) and
``connections`` set; another protocol class (``--http zttp``, HTTP/2) is left as it is, with one warning.
"""
from __future__ import annotations

import functools
import importlib
import logging

from . import connections as core

logger = logging.getLogger("qwen_vllm_ext.connections")

_MARK = "_qwen_vllm_ext_connection_guard"
LAUNCHER = "vllm.entrypoints.launchers.launcher"

# Compatibility guard (qwen_vllm_ext.integration.guard): what install() wraps or relies on -> fingerprint per vLLM
# version. __init__ is wrapped; _connect (several API-server processes) must keep building its protocol from
# config.http_protocol_class.
PATCH_TARGETS = {
    f"{LAUNCHER}:NoSignalServer.__init__": {"0.32.0": "864d3bcff2b32c2e", "0.33.0": "864d3bcff2b32c2e"},
    f"{LAUNCHER}:NoSignalServer._connect": {"0.32.0": "2c98510915e31218", "0.33.0": "2c98510915e31218"},
}

_servers: list = []  # (protocol class) of each server guarded in this process, newest last


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one where allowed; (soft before, soft after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nr_open = None
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            nr_open = int(f.read().strip())
    except (OSError, ValueError):
        pass
    target = core.fd_limit_target(soft, hard, resource.RLIM_INFINITY, nr_open)
    if target is None:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("qwen-vllm-ext: could not raise the open-file limit from %s to %s: %s", soft, target, exc)
        return soft, soft
    logger.info("qwen-vllm-ext: open-file limit (RLIMIT_NOFILE soft) raised from %s to %s", soft, target)
    return soft, target


def current_fd_limit() -> int | None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def limits_for(settings) -> core.ConnectionLimits:
    return core.connection_limits(settings.header_timeout_s, settings.max_connections, settings.connection_fd_reserve,
                                  current_fd_limit())


def _known_protocols() -> tuple[type, ...]:
    known = []
    for module, name in (("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol"),
                         ("uvicorn.protocols.http.h11_impl", "H11Protocol")):
        try:
            known.append(getattr(importlib.import_module(module), name))
        except ImportError:  # httptools is optional
            pass
    return tuple(known)


def guarded_protocol(base: type, limits: core.ConnectionLimits) -> type:
    """``base`` (uvicorn's httptools or h11 protocol) with the header timeout and the connection cap of ``limits``.

    One class per server: its ``table`` (``connections.ConnectionTable``) holds the server's waiting connections and
    counters; ``status()`` reports them."""
    table = core.ConnectionTable(limits)
    timeout = limits.header_timeout_s

    class Guarded(base):  # type: ignore[misc, valid-type]
        _qwen_table = table
        _qwen_timer = None
        _qwen_armed_cycle = None
        _qwen_refused = False
        _qwen_linger = None
        _qwen_connections: set = set()  # the server's open connections (uvicorn's set, seen at the first accept)

        # ---- accept: the cap --------------------------------------------------------------------------------
        def connection_made(self, transport) -> None:
            now = self.loop.time()
            decision, victim = table.admit(len(self.connections), now)
            if decision in (core.REFUSE, core.RESET):
                self._qwen_refuse(transport, decision)
                return
            if victim is not None:
                victim._qwen_close(core.evicted_response())
            Guarded._qwen_connections = self.connections
            super().connection_made(transport)
            self._qwen_arm(now)

        def _qwen_refuse(self, transport, decision) -> None:
            self._qwen_refused = True
            self.transport = transport
            if decision == core.RESET:
                transport.abort()
                return
            transport.write(core.refusal_response(limits.cap))
            # read and drop what the client sends until it closes (or REFUSAL_LINGER_S), so the close is a FIN
            self._qwen_linger = self.loop.call_later(core.REFUSAL_LINGER_S, transport.close)

        # ---- the header timer -------------------------------------------------------------------------------
        def _qwen_arm(self, now: float) -> None:
            if not timeout:
                return
            self._qwen_armed_cycle = self.cycle
            self._qwen_timer = self.loop.call_later(timeout, self._qwen_timeout)
            table.waiting(self, now)

        def _qwen_disarm(self) -> None:
            if self._qwen_timer is not None:
                self._qwen_timer.cancel()
                self._qwen_timer = None
            table.done(self)

        def _qwen_timeout(self) -> None:
            self._qwen_timer = None
            cycle = self.cycle
            gone = self.transport.is_closing() or self.transport.get_protocol() is not self  # closing, or a WebSocket
            if core.timer_should_close(self._qwen_armed_cycle, cycle, cycle is not None and cycle.response_complete,
                                       gone):
                table.timed_out(self)
                self._qwen_close(core.header_timeout_response(timeout))
            else:
                table.done(self)

        def _qwen_close(self, response: bytes) -> None:
            self._qwen_disarm()
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._qwen_refused:
                return
            super().data_received(data)
            if self._qwen_timer is not None:
                # a request head arrived, or the connection became a WebSocket (another protocol)
                if self.cycle is not self._qwen_armed_cycle or self.transport.get_protocol() is not self:
                    self._qwen_disarm()
            elif timeout and self.cycle is not None and self.cycle.response_complete \
                    and not self.transport.is_closing() and self.transport.get_protocol() is self:
                # the first byte of a next request on a kept-alive connection (uvicorn just cancelled its keep-alive
                # timer): its head gets header_timeout_s too
                self._qwen_arm(self.loop.time())

        def eof_received(self):
            if self._qwen_refused:
                return None  # the transport closes
            return super().eof_received()

        def connection_lost(self, exc) -> None:
            if self._qwen_refused:
                if self._qwen_linger is not None:
                    self._qwen_linger.cancel()
                    table.refusal_closed()
                    self._qwen_linger = None
                return
            self._qwen_disarm()
            super().connection_lost(exc)

        @classmethod
        def _qwen_status(cls) -> dict:
            return table.status(len(cls._qwen_connections))

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def guard_config(config, settings) -> type | None:
    """Replace a uvicorn config's protocol class by the guarded one (loads the config first if needed); the class,
    or None where the protocol is not one of uvicorn's HTTP/1.1 protocols."""
    if not config.loaded:
        config.load()
    base = config.http_protocol_class
    if getattr(base, "_qwen_table", None) is not None:
        return base
    if not (isinstance(base, type) and issubclass(base, _known_protocols())):
        logger.warning("qwen-vllm-ext: HTTP protocol %r is not uvicorn's httptools or h11 protocol: no header "
                       "timeout or connection cap on this server", base)
        return None
    limits = limits_for(settings)
    guarded = guarded_protocol(base, limits)
    config.http_protocol_class = guarded
    _servers.append(guarded)
    logger.info("qwen-vllm-ext: connections: header timeout %s, at most %d open (%s)",
                f"{limits.header_timeout_s:g} s" if limits.header_timeout_s else "off", limits.cap, limits.how)
    return guarded


def install(settings) -> bool:
    """Apply the patch (idempotent); False when the setting is off. Raises the open-file limit first, and checks
    the settings (a bad value fails here, naming the setting)."""
    if not settings.connection_guard:
        return False
    core.connection_limits(settings.header_timeout_s, settings.max_connections, settings.connection_fd_reserve, None)
    launcher = importlib.import_module(LAUNCHER)
    cls = launcher.NoSignalServer
    if getattr(cls, _MARK, False):
        return True
    if settings.raise_fd_limit:
        raise_fd_limit()
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        guard_config(config, settings)
        original(self, config, *args, **kwargs)

    cls.__init__ = __init__
    setattr(cls, _MARK, True)
    return True


def status() -> dict | None:
    """The newest guarded server of this process: its limits, open connections and counters (None: none yet)."""
    if not _servers:
        return None
    return _servers[-1]._qwen_status()
