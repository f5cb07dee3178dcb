"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``), from the hidden states of the
prefill that computes the prompt's KV: no second forward.

The row of position ``p`` predicts the token at ``p + 1``. In a step, that token is the next
one of the same range, or the first of the request's range that starts at ``p + 1``; the last
row of a chunked prefill's step waits, as its ``log_softmax`` row ``[V]``, for the next step's
first token (one row per request held on the device). The sampling row of the prompt's last
position predicts an output token: it is not a prompt log-probability, and rows after a
request's first sample are not computed::

    positions   0    1    2  | 3    4    5  (next step)  | 6 = sampled
    targets     1    2   [3] | 4    5   (sampled: none)
                        held until step 2

Results are keyed by the position of the token they score (1..n-1; position 0 has none), so a
recomputed range simply gives the same positions again.
"""

from __future__ import annotations

from typing import Any

import torch

from pensieve.core.outputs import ScheduledRequest, TokenLogprobs

ROWS_PER_SLICE = 256
"""Rows whose logits are computed at once (``[256, V]`` float32: ~50 MB at V = 49,152)."""


class PromptLogprobs:
    """The rows held across steps, and the computation of one step's prompt log-probs."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, torch.Tensor]] = {}
        """Request id -> (position the row scores, its ``log_softmax`` row ``[V]``)."""
        self.done: set[str] = set()
        """Requests that sampled already (their later rows score output tokens)."""

    def wanted(self, reqs: list[ScheduledRequest]) -> bool:
        """Whether a request of the step still scores its prompt."""
        return any(s.sampling_params.prompt_logprobs is not None and s.request_id not in self.done
                   for s in reqs)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.held.pop(rid, None)
            self.done.discard(rid)

    def compute(self, model: Any, hidden: torch.Tensor, reqs: list[ScheduledRequest],
                req_of_range: Any, starts: Any, ends: Any, qlens: Any, ids: list[int]
                ) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """The prompt log-probs of this step's asking requests. ``hidden``: ``[T, H]``, the
        step's hidden states; the range arrays are :class:`~.step_layout.RangeLayout`'s."""
        out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        for i, s in enumerate(reqs):
            k = s.sampling_params.prompt_logprobs
            if k is None or s.request_id in self.done:
                continue
            rows: list[int] = []
            targets: list[tuple[int, int]] = []  # (scored position, token id)
            mine = sorted((int(starts[j]), int(ends[j] - qlens[j]), int(qlens[j]))
                          for j in range(len(req_of_range)) if int(req_of_range[j]) == i)
            got = out.setdefault(s.request_id, [])
            first_pos, first_row, _ = mine[0]
            held = self.held.pop(s.request_id, None)
            if held is not None and held[0] == first_pos:
                got.append((first_pos, _entry(held[1], ids[first_row], k)))
            for start, row0, n in mine:
                for j in range(n):
                    rows.append(row0 + j)
                    targets.append((start + j + 1, ids[row0 + j + 1] if j + 1 < n else -1))
            # a range's last row scores the first token of the range after it, if in this step
            nxt = {start: ids[row0] for start, row0, _ in mine}
            targets = [(p, t if t >= 0 else nxt.get(p, -1)) for p, t in targets]
            got += self._rows(model, hidden, rows, targets, k, s)
            if s.sample:
                self.done.add(s.request_id)
        return {rid: v for rid, v in out.items() if v}

    def _rows(self, model: Any, hidden: torch.Tensor, rows: list[int],
              targets: list[tuple[int, int]], k: int, s: ScheduledRequest
              ) -> list[tuple[int, TokenLogprobs]]:
        got: list[tuple[int, TokenLogprobs]] = []
        dev = hidden.device
        for a in range(0, len(rows), ROWS_PER_SLICE):
            part = targets[a:a + ROWS_PER_SLICE]
            idx = torch.tensor(rows[a:a + ROWS_PER_SLICE], device=dev)
            lp = model.compute_logits(hidden[idx]).float().log_softmax(dim=-1)  # [R, V]
            valid = [r for r, (_, tok) in enumerate(part) if tok >= 0]
            if valid:
                vi = torch.tensor(valid, device=dev)
                toks = torch.tensor([part[r][1] for r in valid], device=dev)
                chosen = lp[vi].gather(1, toks[:, None])[:, 0].tolist()  # [R']
                top_v: list[list[float]] = [[] for _ in valid]
                top_i: list[list[int]] = [[] for _ in valid]
                if k:
                    tv, ti = lp[vi].topk(min(k, lp.shape[-1]), dim=-1)  # [R', k]
                    top_v, top_i = tv.tolist(), ti.tolist()
                got += [(part[r][0], TokenLogprobs(chosen[j], tuple(zip(top_i[j], top_v[j]))))
                        for j, r in enumerate(valid)]
            last = len(part) - 1
            if a + last == len(rows) - 1 and part[last][1] < 0 and not s.sample:
                self.held[s.request_id] = (part[last][0], lp[last].clone())  # next step's
        return got


def _entry(lp: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``lp``: one ``[V]`` log-softmax row; the token's value and the ``k`` most likely."""
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, tok_ids = lp.topk(min(k, lp.shape[-1]))
        top = tuple(zip(tok_ids.tolist(), vals.tolist()))
    return TokenLogprobs(float(lp[token]), top)
