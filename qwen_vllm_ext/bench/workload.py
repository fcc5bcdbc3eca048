"""Workloads (pure, seeded): token-length distributions, arrival processes and JSONL traces.

* lengths: ``fixed``; ``normal`` (mean/std, clipped); ``long_tail`` (normal, plus ``tail_fraction`` of prompts
  uniform in ``[tail_min, tail_max]``: the report's 5% up to 10,000 tokens); ``burst`` (normal lengths, and the
  arrival rate multiplied by ``burst_factor`` for ``burst_s`` seconds of every ``burst_period_s``);
* arrivals: ``poisson`` or ``gamma`` (shape ``gamma_shape``: < 1 burstier, > 1 more regular) at ``rate`` req/s,
  ``constant``, or closed loop (no arrival times; ``concurrency`` workers);
* a JSONL trace: one object per line with ``prompt_tokens`` (or ``input_length``), ``output_tokens`` (or
  ``output_length``), optional ``timestamp`` (seconds from the start) and optional ``session`` (lines with the
  same session run in order, as turns of one conversation).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from typing import Iterable

DISTRIBUTIONS = ("fixed", "normal", "long_tail", "burst")
ARRIVALS = ("poisson", "gamma", "constant")


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    distribution: str = "normal"
    input_mean: int = 2000
    input_std: float | None = None  # default: mean / 4
    output_mean: int = 128
    output_std: float = 0.0
    min_input: int = 16
    min_output: int = 1
    tail_fraction: float = 0.05
    tail_min: int | None = None  # default: 2 x input_mean
    tail_max: int = 10_000
    max_model_len: int | None = None  # prompt + output never above it (prompts are shortened)

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.distribution!r}; expected one of {DISTRIBUTIONS} "
                             "or a .jsonl trace")
        if self.input_mean < 1 or self.output_mean < 1:
            raise ValueError("input and output lengths must be >= 1")
        if not 0 <= self.tail_fraction <= 1:
            raise ValueError("tail_fraction must be within [0, 1]")


@dataclasses.dataclass(frozen=True)
class ArrivalSpec:
    process: str = "poisson"  # or gamma, constant, closed
    rate: float = 1.0  # requests (sessions) per second
    gamma_shape: float = 1.0
    concurrency: int = 0  # > 0: closed loop
    burst_factor: float = 1.0
    burst_s: float = 10.0
    burst_period_s: float = 60.0

    def __post_init__(self):
        if self.concurrency < 0:
            raise ValueError("concurrency must be >= 0")
        if self.concurrency == 0:
            if self.process not in ARRIVALS:
                raise ValueError(f"unknown arrival process {self.process!r}; expected one of {ARRIVALS}")
            if not self.rate > 0 or math.isinf(self.rate):
                raise ValueError("rate must be a positive number of requests per second")
            if self.gamma_shape <= 0:
                raise ValueError("gamma_shape must be > 0")
        if self.burst_factor < 1 or self.burst_s < 0 or self.burst_period_s <= 0 or self.burst_s > self.burst_period_s:
            raise ValueError("need burst_factor >= 1 and 0 <= burst_s <= burst_period_s")


@dataclasses.dataclass
class Turn:
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass
class Session:
    """One arrival: a conversation of one or more turns (sent one after the other)."""

    index: int
    arrival_s: float | None  # None: closed loop
    turns: list[Turn]


def _clip(v: float, lo: int, hi: int | None) -> int:
    v = int(round(v))
    v = max(lo, v)
    return min(v, hi) if hi is not None else v


def sample_lengths(spec: LengthSpec, rng: random.Random) -> Turn:
    out = spec.output_mean if spec.output_std <= 0 else _clip(rng.gauss(spec.output_mean, spec.output_std),
                                                               spec.min_output, None)
    if spec.distribution == "fixed":
        prompt = spec.input_mean
    else:
        std = spec.input_mean / 4 if spec.input_std is None else spec.input_std
        prompt = _clip(rng.gauss(spec.input_mean, std), spec.min_input, None)
        if spec.distribution == "long_tail" and rng.random() < spec.tail_fraction:
            lo = spec.tail_min if spec.tail_min is not None else 2 * spec.input_mean
            prompt = rng.randint(min(lo, spec.tail_max), spec.tail_max)
    if spec.max_model_len is not None:
        out = min(out, max(1, spec.max_model_len - spec.min_input))
        prompt = min(prompt, spec.max_model_len - out)
    return Turn(max(spec.min_input if spec.distribution != "fixed" else 1, prompt), max(1, out))


def rate_at(spec: ArrivalSpec, t: float, burst: bool) -> float:
    if burst and spec.burst_factor > 1 and (t % spec.burst_period_s) < spec.burst_s:
        return spec.rate * spec.burst_factor
    return spec.rate


def arrival_times(spec: ArrivalSpec, n: int, duration_s: float, rng: random.Random, burst: bool = False) -> list[float]:
    """Up to ``n`` arrival times in ``[0, duration_s)`` (open loop)."""
    times: list[float] = []
    t = 0.0
    peak = spec.rate * (spec.burst_factor if burst else 1.0)
    while len(times) < n:
        if spec.process == "constant":  # the first request at 0, then one every 1/rate seconds
            if times:
                t += 1.0 / rate_at(spec, t, burst)
        elif spec.process == "gamma":
            r = rate_at(spec, t, burst)
            t += rng.gammavariate(spec.gamma_shape, 1.0 / (spec.gamma_shape * r))
        else:  # Poisson; time-varying rate by thinning
            t += rng.expovariate(peak)
            if rng.random() > rate_at(spec, t, burst) / peak:
                continue
        if t >= duration_s - 1e-9:
            break
        times.append(t)
    return times


def build_sessions(lengths: LengthSpec, arrivals: ArrivalSpec, num_requests: int, duration_s: float,
                   seed: int = 0, turns: int = 1) -> list[Session]:
    """Sessions for a synthetic workload: at most ``num_requests`` requests in total (turns included)."""
    if num_requests < 1 or duration_s <= 0:
        raise ValueError("num_requests must be >= 1 and duration_s > 0")
    if turns < 1:
        raise ValueError("turns must be >= 1")
    rng = random.Random(seed)
    n_sessions = math.ceil(num_requests / turns)
    burst = lengths.distribution == "burst"
    if arrivals.concurrency:
        times: list[float | None] = [None] * n_sessions
    else:
        times = list(arrival_times(arrivals, n_sessions, duration_s, rng, burst))
    sessions, left = [], num_requests
    for i, t in enumerate(times):
        k = min(turns, left)
        sessions.append(Session(i, t, [sample_lengths(lengths, rng) for _ in range(k)]))
        left -= k
    return sessions


def _int_field(obj: dict, names: Iterable[str], line: int) -> int:
    for name in names:
        if name in obj:
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"trace line {line}: {name} must be a positive integer, got {v!r}")
            return v
    raise ValueError(f"trace line {line}: missing {' or '.join(names)}")


def load_trace(path: str, num_requests: int, duration_s: float, max_model_len: int | None = None) -> list[Session]:
    """Sessions from a JSONL trace (bounded by ``num_requests`` and ``duration_s`` like synthetic workloads)."""
    by_session: dict[str, Session] = {}
    order: list[Session] = []
    count = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                raise ValueError(f"trace line {lineno} is not JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"trace line {lineno} must be a JSON object")
            prompt = _int_field(obj, ("prompt_tokens", "input_length"), lineno)
            out = _int_field(obj, ("output_tokens", "output_length"), lineno)
            if max_model_len is not None:
                out = min(out, max_model_len - 16)
                prompt = min(prompt, max_model_len - out)
            ts = obj.get("timestamp")
            if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0):
                raise ValueError(f"trace line {lineno}: timestamp must be seconds >= 0, got {ts!r}")
            if ts is not None and ts >= duration_s:
                continue
            if count >= num_requests:
                break
            key = obj.get("session")
            turn = Turn(prompt, out)
            if key is not None and str(key) in by_session:
                by_session[str(key)].turns.append(turn)
            else:
                s = Session(len(order), None if ts is None else float(ts), [turn])
                order.append(s)
                if key is not None:
                    by_session[str(key)] = s
            count += 1
    if not order:
        raise ValueError(f"trace {path} has no requests within the bounds")
    return order
