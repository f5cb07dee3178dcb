"""Per-request logits processors: ``logit_bias``, ``min_tokens``, the repetition, frequency
and presence penalties, and ``min_p``.

Each processor is one batched function over the rows that ask for it, on whatever device the
logits are on. :func:`process_logits` applies them in vLLM's order before picking (greedy or
random), to a copy: the raw logits stay for log-probabilities. Semantics are HF's and
OpenAI's:

- repetition (HF ``RepetitionPenaltyLogitsProcessor``, over prompt and output tokens as
  vLLM): a seen token's logit ``l`` becomes ``l / p`` if ``l > 0`` else ``l * p``;
- frequency and presence (OpenAI, over output tokens): ``l -= f * count + pr * (count > 0)``;
- ``min_tokens`` (HF ``MinNewTokensLengthLogitsProcessor``, with stop ids as vLLM): the
  end-of-sequence and stop ids get ``-inf`` until that many tokens are generated;
- ``min_p`` (HF ``MinPLogitsWarper``), after temperature: tokens with probability below
  ``min_p`` times the top one's get ``-inf``.
"""

from __future__ import annotations

import torch

from pensieve.core.outputs import TokenHistory
from pensieve.core.sampling_params import SamplingParams


def _counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` float32 occurrence counts of each row's token ids (ids >= vocab ignored)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.zeros(len(seqs), vocab + 1, device=device)
    if width == 0:
        return out[:, :vocab]
    padded = [s + [vocab] * (width - len(s)) for s in seqs]
    idx = torch.tensor(padded, dtype=torch.long, device=device).clamp_(0, vocab)  # [R, L]
    out.scatter_add_(1, idx, torch.ones(idx.shape, device=device))
    return out[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` in place. logits: ``[N, V]``."""
    vocab = logits.shape[-1]
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias:
            if tok < vocab:  # the engine refuses larger ids; a guard, never an index error
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[TokenHistory | None]) -> None:
    """Mask, in place, end-of-sequence and stop ids of rows short of ``min_tokens``."""
    vocab = logits.shape[-1]
    rows, cols = [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        if h is None or len(h.output_token_ids) >= p.min_tokens:
            continue
        for tok in set(h.eos_token_ids) | set(p.stop_token_ids):
            if tok < vocab:
                rows.append(i)
                cols.append(tok)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[TokenHistory | None]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that have them."""
    rows = [i for i, (p, h) in enumerate(zip(params, histories))
            if h is not None and p.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]  # [R, V]
    hist = [histories[i] for i in rows]
    out_counts = _counts([list(h.output_token_ids) for h in hist if h is not None], vocab, dev)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        seen = _counts([list(h.prompt_token_ids) for h in hist if h is not None], vocab, dev)
        seen = (seen + out_counts) > 0
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    logits[idx] = sub.to(logits.dtype)


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[TokenHistory | None] | None) -> torch.Tensor:
    """The logits the sampler picks from: ``logits`` itself when no row asks for a
    processor, else a float32 copy with ``logit_bias``, ``min_tokens`` and the penalties
    applied (vLLM's order). logits: ``[N, V]``; histories: one per row (None: none needed)."""
    if not any(p.processes_logits for p in params):
        return logits
    hist: list[TokenHistory | None] = (list(histories) if histories is not None
                                       else [None] * len(params))
    out = logits.float().clone()
    apply_logit_bias(out, params)
    apply_min_tokens(out, params, hist)
    apply_penalties(out, params, hist)
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask, in place, tokens whose probability is below ``min_p`` times the row's top one.
    logits: ``[N, V]`` after temperature; min_p: ``[N]`` (0: off for that row)."""
    probs = logits.softmax(dim=-1)
    top = probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < min_p[:, None] * top, float("-inf"))
