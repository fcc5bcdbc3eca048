"""Idle sleep of the engine: pure timer and wake logic (no vLLM import; clock and engine calls injected).

After ``idle_s`` seconds without a request in flight the engine is put to sleep (vLLM's sleep mode frees the
GPU: weights offloaded, KV cache discarded). The next request wakes it and waits for the wake — it never fails
because the engine was asleep. Guarantees (unit-tested):

* never sleeps while a request is in flight, nor while one is waiting to start;
* one transition at a time: requests arriving while the engine falls asleep wait for that, then ONE of them
  wakes it and the others wait for the same wake;
* a failed wake raises to the requests that waited (they answer 503) and the next request tries again;
* the ledger is untouched: sleeping only happens with zero requests in flight, and records are written by the
  API server, which never sleeps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling_asleep", "asleep", "waking"


class IdleSleeper:
    def __init__(self, idle_s: float, sleep: Callable[[], Awaitable[None]], wake: Callable[[], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic, on_event: Callable[[str, float], None] | None = None):
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.idle_s = idle_s
        self._sleep, self._wake, self._clock = sleep, wake, clock
        self._on_event = on_event  # (event, seconds): "sleep"/"wake" with the transition's duration
        self.state = AWAKE
        self.in_flight = 0
        self.last_active = clock()
        self.sleeps = self.wakes = 0
        self._lock = asyncio.Lock()

    def idle_for(self) -> float:
        return self._clock() - self.last_active

    async def enter(self) -> None:
        """A request starts: count it in flight, then wake the engine if needed (waits for it)."""
        self.in_flight += 1
        self.last_active = self._clock()
        if self.state == AWAKE:
            return
        try:
            async with self._lock:  # a sleep in progress finishes first; only one waker at a time
                if self.state == ASLEEP:
                    self.state = WAKING
                    started = self._clock()
                    try:
                        await self._wake()
                    except BaseException:
                        self.state = ASLEEP
                        raise
                    self.state = AWAKE
                    self.wakes += 1
                    self._event("wake", self._clock() - started)
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        """A request ended (however it ended)."""
        self.in_flight -= 1
        self.last_active = self._clock()

    async def tick(self) -> bool:
        """Put the engine to sleep if it has been idle long enough; True if it did."""
        if self.state != AWAKE or self.in_flight or self.idle_for() < self.idle_s:
            return False
        async with self._lock:
            if self.state != AWAKE or self.in_flight or self.idle_for() < self.idle_s:
                return False
            self.state = FALLING_ASLEEP
            started = self._clock()
            try:
                await self._sleep()
            except BaseException:
                self.state = AWAKE  # still awake; try again after another idle period
                self.last_active = self._clock()
                raise
            self.state = ASLEEP
            self.sleeps += 1
            self._event("sleep", self._clock() - started)
            return True

    async def run(self, poll_s: float = 1.0, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Background loop: ``tick`` every ``poll_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(min(poll_s, self.idle_s))
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
                if on_error is not None:
                    on_error(exc)

    def _event(self, name: str, seconds: float) -> None:
        if self._on_event is not None:
            self._on_event(name, seconds)

    def status(self) -> dict:
        return {"state": self.state, "idle_s": self.idle_s, "in_flight": self.in_flight,
                "idle_for_s": round(self.idle_for(), 3), "sleeps": self.sleeps, "wakes": self.wakes}
