"""The seeded-sampling fix of the CPU runner (qwen_vllm_ext.sampling.cpu_seeds) on real CPU torch generators: vLLM's
rewind of a discarded row's generator raises on the CPU; wrapped, the discarded draw leaves the seeded stream where it
was and nothing raises."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from qwen_vllm_ext.sampling import cpu_seeds


class Runner:
    """The two methods as vLLM 0.32 has them, reduced to what touches the generators."""

    def __init__(self, seeds, discard):
        self.input_batch = types.SimpleNamespace(
            generators={i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s is not None},
            num_reqs=len(seeds))
        self.discard_request_mask = types.SimpleNamespace(np=np.array(discard + [False] * 4, dtype=bool))

    def _sample(self, logits=None, spec_decode_metadata=None):
        return {i: torch.rand(4, generator=g) for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self, *args):
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:  # vLLM's own loop
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "bookkept"


def test_stock_runner_dies_on_a_discarded_seeded_row():
    runner = Runner([None, 7], [False, True])
    runner._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        runner._bookkeeping_sync()


def test_wrapped_the_discarded_draw_leaves_the_stream_unchanged():
    cls = type("Wrapped", (Runner,), {})
    assert cpu_seeds.wrap(cls) and cpu_seeds.wrap(cls)  # idempotent
    runner = cls([None, 7, 9], [False, True, False])
    drawn = runner._sample()
    assert runner._bookkeeping_sync() == "bookkept"
    assert set(runner.input_batch.generators) == {1, 2}  # the hidden generator is back
    fresh7, fresh9 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(9)
    # row 1 (discarded): its next draw is the first draw of seed 7, as if the chunk had not been sampled
    assert torch.equal(torch.rand(4, generator=runner.input_batch.generators[1]), torch.rand(4, generator=fresh7))
    # row 2 (kept): its draw advanced its stream as usual
    assert torch.equal(drawn[2], torch.rand(4, generator=fresh9))
    assert torch.equal(torch.rand(4, generator=runner.input_batch.generators[2]), torch.rand(4, generator=fresh9))


def test_only_discarded_cpu_generators_are_touched():
    gens = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    assert set(cpu_seeds.discarded_cpu_generators(gens, np.array([True, True, False]), 3)) == {0}
    assert cpu_seeds.discarded_cpu_generators(gens, np.array([True, True, True]), 2) == {0: gens[0]}
