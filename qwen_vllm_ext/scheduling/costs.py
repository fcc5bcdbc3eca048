"""What an engine step costs, and what a request costs, in the engine's own measured terms (pure Python).

A step's duration is modelled as linear in its composition (:class:`StepCostModel`)::

    seconds = base + per_request x requests + per_token x tokens
              + per_ctx x prefill context + per_decode_ctx x decode context

(prefill context: the sum over prefill chunks of chunk tokens x (tokens before the chunk + half the chunk), causal
attention's quadratic part, the same total however a prompt is chunked; decode context: the decoding requests'
total context, their attention reads). :class:`CostFit` fits it by least squares — to a finished run's step
records (the offline simulator) or online, with exponential forgetting, to the steps the engine has just run (the
token-weighted scheduler). The solver is the one below for both.

From a fitted model and the engine's mean batch size, :meth:`StepCostModel.request_weight` prices a waiting request
in *prefill-token equivalents*: its uncached prompt's prefill cost plus its output tokens' share of the decode steps
they ride in, divided by the cost of one prefill token. On an engine whose prefill is expensive relative to a decode
step (a large model on a GPU) a long prompt weighs about its length; on one whose batch slots are the bottleneck (the
tiny CPU demo model) every output token weighs many prompt tokens, and prompts of different lengths cost nearly the
same — the token-weighted order then has little to reorder, which is the point.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

FEATURES = ("base", "per_request", "per_token", "per_ctx", "per_decode_ctx")


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Seconds per engine step, linear in the step's composition (see the module doc)."""

    base: float = 0.006
    per_request: float = 0.0002
    per_token: float = 0.0003
    per_ctx: float = 0.0
    per_decode_ctx: float = 0.0

    def cost(self, n_reqs: int, tokens: int, prefill_ctx: float, decode_ctx: float = 0.0) -> float:
        return max(self.base + self.per_request * n_reqs + self.per_token * tokens + self.per_ctx * prefill_ctx
                   + self.per_decode_ctx * decode_ctx, 1e-4)

    def price(self, record: Sequence[float]) -> float:
        """The cost of a recorded step (a ``bench_scheduler.py`` ``comp`` row; rows without the decode-context
        column price it at 0)."""
        return self.cost(record[2], record[3], record[5], record[6] if len(record) > 6 else 0.0)

    def request_weight(self, uncached: int, cached: int, output: int, batch: float) -> float | None:
        """A request's cost in prefill-token equivalents: (prefill of ``uncached`` prompt tokens after ``cached``
        ones + ``output`` decode steps, each a ``1/batch`` share of a step's base cost plus the request's own
        per-request, per-token and context cost) / ``per_token``. None when ``per_token`` is not positive (the model
        cannot price a prompt token: use the token weight)."""
        if not self.per_token > 0:
            return None
        uncached, cached, output = max(uncached, 0), max(cached, 0), max(output, 0)
        prefill = self.per_token * uncached + self.per_ctx * uncached * (cached + uncached / 2)
        context = cached + uncached + output / 2
        decode = output * (self.base / max(batch, 1.0) + self.per_request + self.per_token
                           + self.per_decode_ctx * context)
        return (prefill + decode) / self.per_token

    def output_weight(self, context: float, batch: float) -> float | None:
        """What one output token weighs in prefill tokens, for a request at ``context`` tokens in a batch of
        ``batch`` (:meth:`request_weight` of one output token with no prompt)."""
        return self.request_weight(0, int(context), 1, batch)


def features(n_reqs: float, tokens: float, prefill_ctx: float, decode_ctx: float) -> tuple[float, ...]:
    """The regressors of one step, in :data:`FEATURES` order."""
    return (1.0, float(n_reqs), float(tokens), float(prefill_ctx), float(decode_ctx))


class CostFit:
    """Least-squares fit of :class:`StepCostModel` from (step features, seconds) samples.

    Keeps only the normal equations (5 x 5), so it runs online at no memory cost; ``forget`` (0 < f <= 1) scales
    the old samples down by f at each new one (1.0: a batch fit over everything). Features are scaled by their
    running maxima before solving; coefficients that come out negative (noise, not physics) are fixed at 0 and the
    rest re-solved, and a feature never seen is left at 0.
    """

    def __init__(self, forget: float = 1.0) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget!r}")
        self.forget = forget
        n = len(FEATURES)
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.yty = 0.0
        self.ysum = 0.0
        self.weight = 0.0
        """Sum of the (forgotten) sample weights: the effective number of samples."""
        self.samples = 0
        self._scale = [1.0] * n

    def add(self, x: Sequence[float], seconds: float) -> None:
        f = self.forget
        n = len(FEATURES)
        if f < 1.0:
            for i in range(n):
                row = self.xtx[i]
                for j in range(n):
                    row[j] *= f
                self.xty[i] *= f
            self.yty *= f
            self.ysum *= f
            self.weight *= f
        for i in range(n):
            self._scale[i] = max(self._scale[i], abs(x[i]))
            xi = x[i]
            if xi:
                row = self.xtx[i]
                for j in range(n):
                    row[j] += xi * x[j]
                self.xty[i] += xi * seconds
        self.yty += seconds * seconds
        self.ysum += seconds
        self.weight += 1.0
        self.samples += 1

    def add_many(self, samples: Iterable[tuple[Sequence[float], float]]) -> None:
        for x, y in samples:
            self.add(x, y)

    def solve(self) -> StepCostModel | None:
        """The current fit (None with fewer than 8 samples or a singular system)."""
        if self.samples < 8:
            return None
        n = len(FEATURES)
        s = self._scale
        active = [i for i in range(n) if self.xtx[i][i] > 0]
        while active:
            a = [[self.xtx[i][j] / (s[i] * s[j]) for j in active] for i in active]
            b = [self.xty[i] / s[i] for i in active]
            sol = _solve(a, b)
            if sol is None:
                return None
            negative = [k for k, v in zip(active, sol) if v < 0]
            if not negative:
                coef = [0.0] * n
                for k, v in zip(active, sol):
                    coef[k] = v / s[k]
                return StepCostModel(*coef)
            worst = min(zip(sol, active))[1]
            active.remove(worst)
        return None

    def r2(self, model: StepCostModel) -> float:
        """Coefficient of determination of ``model`` over the (weighted) samples."""
        c = [getattr(model, f) for f in FEATURES]
        n = len(FEATURES)
        pred_y = sum(c[i] * self.xty[i] for i in range(n))
        pred_pred = sum(c[i] * c[j] * self.xtx[i][j] for i in range(n) for j in range(n))
        ss_res = self.yty - 2 * pred_y + pred_pred
        mean = self.ysum / self.weight if self.weight else 0.0
        ss_tot = self.yty - self.weight * mean * mean
        return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (a tiny dense system); None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in m[pivot][:n])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for k in range(col, n + 1):
                    m[r][k] -= factor * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x if all(math.isfinite(v) for v in x) else None
