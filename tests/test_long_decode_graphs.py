"""Decode graphs by context length class: where a context can reach ``LONG_DECODE_KV``, each
bucket is captured for the short and the long class, and a step replays the class of its
longest context (run eagerly here: CUDA graphs need a GPU, the class choice does not)."""

from __future__ import annotations

import pytest
import torch

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.kernels.launch_policy import LONG_DECODE_KV, decode_kv_splits
from pensieve.runner.cuda_graph import DecodeGraphs

CHUNK, HKV = 16, 2


class _Recorder:
    """A stand-in model: records the attention metadata each forward receives."""

    def __init__(self) -> None:
        self.metas: list = []

    def __call__(self, ids, positions, kv_caches, meta):  # noqa: ANN001, ANN204
        self.metas.append(meta)
        return torch.zeros(ids.shape[0], 4)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + 1.0


def _step(contexts: list[int]) -> SchedulerOutput:
    reqs = []
    for i, c in enumerate(contexts):
        table = tuple(range(i * 1000, i * 1000 + -(-c // CHUNK)))
        reqs.append(ScheduledRequest(f"r{i}", table, [QueryRange(c - 1, [7])], True,
                                     SamplingParams(), 0))
    return SchedulerOutput(requests=reqs)


def _graphs(max_len: int, span_mode: str) -> tuple[DecodeGraphs, _Recorder]:
    model = _Recorder()
    caches = [torch.zeros(2, 4, CHUNK, HKV, 8)]
    g = DecodeGraphs(model, caches, CHUNK, max_batch=8,  # type: ignore[arg-type]
                     max_blocks=max_len // CHUNK, capture=False, span_mode=span_mode)
    return g, model


@pytest.mark.parametrize("span_mode", ["0", "1", "auto"])
def test_step_runs_the_class_of_its_longest_context(span_mode: str) -> None:
    g, model = _graphs(4 * LONG_DECODE_KV, span_mode)
    assert g.tile_classes == (False, True)
    cases = [([100, 200], False), ([100, LONG_DECODE_KV - 1], False),
             ([100, LONG_DECODE_KV], True), ([3 * LONG_DECODE_KV], True)]
    for contexts, long in cases:
        g.run(_step(contexts))
        assert g.long_context == long
        meta = model.metas[-1]
        assert meta.long_context == long
        if g.split_span:  # the span variant's grid follows the class as well
            assert meta.num_kv_splits == decode_kv_splits(g.bucket_for(len(contexts)), HKV,
                                                          g.device, long)
        else:
            assert meta.num_kv_splits is None  # the launcher's, by class


def test_short_models_capture_one_class() -> None:
    g, model = _graphs(LONG_DECODE_KV // 2, "auto")
    assert g.tile_classes == (False,)
    g.run(_step([LONG_DECODE_KV // 2 - 5]))
    assert not g.long_context and not model.metas[-1].long_context
