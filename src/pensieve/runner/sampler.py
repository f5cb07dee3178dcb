"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds;
log-probabilities. The logits processors (penalties, ``logit_bias``, ``min_tokens``) run first,
in :mod:`.logits_processors`.

Sampling uses the exponential-race form of a categorical draw (``argmax(p / E)`` with
``E ~ Exp(1)``), so a seeded request's noise depends only on its seed and output index.
"""

from __future__ import annotations

import torch

from pensieve.core.outputs import TokenHistory, TokenLogprobs
from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.logits_processors import apply_min_p, process_logits

_SEED_STRIDE = 1_000_003


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask, in place, tokens outside each row's top-k and nucleus. logits: ``[N, V]``."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= cum >= top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(-1, sorted_idx, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], num_output_tokens: list[int],
    histories: list[TokenHistory | None] | None = None,
) -> list[int]:
    """Pick one token per row. logits: ``[N, V]`` float32; returns N token ids. ``histories``
    (one per row) feed the processors that read a request's tokens."""
    return sample_tensor(logits, params, num_output_tokens, histories).tolist()


def sample_tensor(
    logits: torch.Tensor, params: list[SamplingParams], num_output_tokens: list[int],
    histories: list[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """:func:`sample` without the read-back: the ``[N]`` int64 token ids on the device."""
    logits = process_logits(logits, params, histories)
    greedy_tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy_tokens
    dev = logits.device
    rows = torch.tensor(random_rows, device=dev)
    sub = logits[rows].float()
    temps = torch.tensor([params[i].temperature for i in random_rows], device=dev)
    sub.div_(temps[:, None])
    top_k = torch.tensor([params[i].top_k for i in random_rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in random_rows], device=dev)
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows):
        _apply_top_k_top_p(sub, top_k, top_p)
    if any(params[i].min_p > 0.0 for i in random_rows):
        apply_min_p(sub, torch.tensor([params[i].min_p for i in random_rows], device=dev))
    probs = sub.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        seed = params[i].seed
        if seed is None:
            noise[j].exponential_()
        else:
            g = torch.Generator(device=dev)
            g.manual_seed((seed * _SEED_STRIDE + num_output_tokens[i]) % (2**63))
            noise[j].exponential_(generator=g)
    picked = (probs / noise).argmax(dim=-1)
    out = greedy_tokens.clone()
    out[rows] = picked
    return out


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> dict[int, TokenLogprobs]:
    """Log-probabilities of the sampled ``tokens`` for the rows whose params ask for them.

    logits: ``[N, V]``, the very logits :func:`sample` picked ``tokens`` (N ids) from. The
    values are the model's, ``log_softmax`` of the unscaled logits in float32 (temperature,
    top-k and top-p do not change them, as in vLLM by default). Returns, by row index, the
    sampled token's log-probability and the row's ``params[i].logprobs`` most likely
    (token, log-probability) pairs, most likely first. Only the asking rows are computed."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    lp = logits[idx].float().log_softmax(dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=dev)[:, None])
    k = max(params[i].logprobs or 0 for i in rows)
    top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [R, k], sorted descending
    chosen_l, top_lp_l, top_ids_l = chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
    out: dict[int, TokenLogprobs] = {}
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen_l[j], tuple(zip(top_ids_l[j][:n], top_lp_l[j][:n])))
    return out
