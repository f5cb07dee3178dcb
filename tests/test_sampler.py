"""Sampler: greedy, top-k, top-p, temperature and per-request seeds."""

from __future__ import annotations

import torch

from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.sampler import sample


def _logits(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_greedy_is_argmax() -> None:
    lg = _logits()
    toks = sample(lg, [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert toks == lg.argmax(-1).tolist()


def test_tiny_temperatures_are_greedy() -> None:
    """Dividing by 1e-300 or a denormal overflows the logits to inf and NaN (sampling then
    picks garbage); below SAMPLING_EPS the temperature counts as 0."""
    lg = _logits(n=8, vocab=200, seed=3)
    for t in (1e-300, 5e-324, 1e-40, 1e-6):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and p.temperature == 0.0
        assert sample(lg, [p] * 8, list(range(8))) == lg.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-3).greedy


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    lg = _logits()
    ps = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)]
    for p in ps:
        assert sample(lg, [p] * 4, [0] * 4) == lg.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    lg = _logits(n=1, vocab=30)
    top3 = set(lg[0].topk(3).indices.tolist())
    seen = {sample(lg, [SamplingParams(temperature=5.0, top_k=3, seed=s)], [0])[0]
            for s in range(200)}
    assert seen <= top3 and len(seen) == 3


def test_top_p_keeps_smallest_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lg = probs.log()
    seen = {sample(lg, [SamplingParams(temperature=1.0, top_p=0.7, seed=s)], [0])[0]
            for s in range(300)}
    assert seen == {0, 1}


def test_seeded_sampling_ignores_batch_composition() -> None:
    lg = _logits(n=3)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(lg[1:2].clone(), [p], [5])[0]
    others = [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.0)]
    batched = sample(lg.clone(), others, [0, 5, 0])[1]
    assert alone == batched
    # a different output index draws different noise: over many indices not all equal
    draws = {sample(lg[1:2].clone(), [p], [i])[0] for i in range(40)}
    assert len(draws) > 1


def test_temperature_sampling_follows_softmax() -> None:
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    counts = torch.zeros(4)
    n = 2000
    for s in range(n):
        counts[sample(probs.log(), [SamplingParams(temperature=1.0, seed=s)], [0])[0]] += 1
    freq = counts / n
    assert torch.allclose(freq, probs[0], atol=0.04), freq
