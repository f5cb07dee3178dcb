"""Logits processors against HF transformers' own processors on the same logits, and their
bounds; mixed batches (processed and plain rows) pick as each row would alone."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pensieve.core.outputs import TokenHistory
from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.logits_processors import apply_min_p, process_logits
from pensieve.runner.sampler import sample

V = 40


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _hist(prompt: list[int], out: list[int], eos: tuple[int, ...] = ()) -> TokenHistory:
    return TokenHistory(prompt, out, eos)


PROMPTS = [[1, 2, 3, 3, 7], [5, 6], [0, 39, 12]]
OUTS = [[3, 9, 9, 2], [], [12, 12, 12, 30]]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hf(penalty: float) -> None:
    lg = _logits(3)
    params = [SamplingParams(temperature=0, repetition_penalty=penalty)] * 3
    ours = process_logits(lg, params, [_hist(p, o) for p, o in zip(PROMPTS, OUTS)])
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(3):  # HF penalizes every token of input_ids: prompt + output here
        ids = torch.tensor([PROMPTS[i] + OUTS[i]])
        want = hf(ids, lg[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], want)


def test_frequency_and_presence_follow_openai_formula() -> None:
    lg = _logits(3, seed=1)
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(frequency_penalty=-2.0),
              SamplingParams(presence_penalty=2.0)]
    ours = process_logits(lg, params, [_hist(p, o) for p, o in zip(PROMPTS, OUTS)])
    for i, p in enumerate(params):
        want = lg[i].clone()
        for tok in set(OUTS[i]):  # output tokens only: the prompt's are not penalized
            c = OUTS[i].count(tok)
            want[tok] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(ours[i], want)
    assert ours[1].equal(lg[1])  # no output yet: nothing to penalize


def test_min_tokens_equals_hf_and_masks_stop_ids() -> None:
    lg = _logits(2, seed=2)
    eos = (4, 5)
    params = [SamplingParams(min_tokens=3, max_tokens=8), SamplingParams(min_tokens=3,
                                                                          max_tokens=8)]
    hists = [_hist([1, 2], [7, 8], eos), _hist([1, 2], [7, 8, 9], eos)]
    ours = process_logits(lg, params, hists)
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3,
                                           eos_token_id=list(eos))
    for i, h in enumerate(hists):
        want = hf(torch.tensor([h.prompt_token_ids + h.output_token_ids]), lg[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], want)
    assert ours[0, 4] == float("-inf") and ours[1, 4] == lg[1, 4]
    # stop ids are masked too (as vLLM), and a masked eos is never sampled
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(6,))
    peaked = torch.zeros(1, V)
    peaked[0, 4], peaked[0, 6], peaked[0, 11] = 10.0, 9.0, 1.0
    assert sample(peaked, [p], [0], [_hist([1], [], (4,))]) == [11]
    assert sample(peaked, [p], [2], [_hist([1], [3, 3], (4,))]) == [4]


def test_logit_bias_equals_hf_sequence_bias() -> None:
    lg = _logits(1, seed=3)
    bias = {3: 5.0, 17: -100.0, 30: 0.25}
    ours = process_logits(lg, [SamplingParams(logit_bias=bias)], None)
    hf = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})
    torch.testing.assert_close(ours, hf(torch.tensor([[1, 2]]), lg.clone()))
    assert sample(lg, [SamplingParams(temperature=0, logit_bias={8: 100.0})], [0]) == [8]


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_equals_hf(min_p: float) -> None:
    lg = _logits(2, seed=4)
    ours = lg.clone()
    apply_min_p(ours, torch.full((2,), min_p))
    want = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(torch.tensor([[0], [0]]), lg.clone())
    assert torch.equal(ours.isinf(), want.isinf())
    # sampling with min_p never leaves the kept set
    kept = set((~ours[0].isinf()).nonzero()[:, 0].tolist())
    seen = {sample(lg[:1], [SamplingParams(temperature=1.0, min_p=min_p, seed=s)], [0])[0]
            for s in range(100)}
    assert seen <= kept


def test_mixed_batch_rows_pick_as_alone() -> None:
    lg = _logits(4, seed=5)
    params = [SamplingParams(temperature=0, repetition_penalty=1.8),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=7, frequency_penalty=1.5, min_p=0.1),
              SamplingParams(temperature=0.8, seed=9, logit_bias={2: 3.0})]
    hists = [_hist([1, 2], [int(lg[0].argmax())]), None, _hist([4], [3, 3, 3]), None]
    batched = sample(lg.clone(), params, [1, 0, 3, 0], hists)
    alone = [sample(lg[i:i + 1].clone(), [params[i]], [[1, 0, 3, 0][i]], [hists[i]])[0]
             for i in range(4)]
    assert batched == alone
    assert batched[1] == int(lg[1].argmax())


def test_raw_logits_untouched() -> None:
    lg = _logits(1)
    before = lg.clone()
    process_logits(lg, [SamplingParams(repetition_penalty=3.0, logit_bias={1: 9.0})],
                   [_hist([1, 2, 3], [4])])
    assert lg.equal(before)


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"repetition_penalty": 0.0},
    {"repetition_penalty": float("nan")}, {"min_p": 1.5}, {"min_tokens": 17},
    {"min_tokens": -1}, {"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}},
    {"logit_bias": {"a": 1.0}}, {"presence_penalty": float("inf")},
])
def test_bounds_refused(kw: dict) -> None:
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **kw)


def test_flags() -> None:
    assert not SamplingParams().processes_logits
    assert SamplingParams(logit_bias={1: 1.0}).processes_logits
    assert not SamplingParams(logit_bias={1: 1.0}).needs_token_history
    assert SamplingParams(min_tokens=1).needs_token_history
    assert SamplingParams(logit_bias={5: 1, 2: -1}).logit_bias == ((2, -1.0), (5, 1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu() -> None:
    """The processors and the picks on the GPU equal the CPU's (greedy rows exactly; the
    processed logits to float tolerance), with processed and plain rows in one batch."""
    lg = _logits(6, seed=6) * 2
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, presence_penalty=0.3),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=2.0, logit_bias={5: 4.0}),
              SamplingParams(temperature=0, min_tokens=3, max_tokens=8,
                             stop_token_ids=(int(lg[3].argmax()),)),
              SamplingParams(temperature=0.7, seed=3, min_p=0.2, top_k=10),
              SamplingParams(temperature=0, logit_bias={1: -100.0, 2: 100.0})]
    hists = [_hist([1, 2, 3, 3], [4, 5, 5]), None, _hist([9], [5, 5, 5, 6]),
             _hist([0], [1], (7,)), _hist([2], [2]), None]
    cpu = process_logits(lg, params, hists)
    gpu = process_logits(lg.cuda(), params, hists)
    torch.testing.assert_close(gpu.cpu(), cpu)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    n = [len(h.output_token_ids) if h else 0 for h in hists]
    on_cpu = sample(lg.clone(), params, n, hists)
    on_gpu = sample(lg.cuda(), params, n, hists)
    assert [on_gpu[i] for i in greedy] == [on_cpu[i] for i in greedy]
    assert on_gpu[5] == 2 and on_gpu[3] != int(lg[3].argmax())
