"""``echo`` and prompt log-probabilities on ``/v1/completions``, as vLLM returns them.

``echo: true`` puts the prompt before the answer in ``choices[i].text``; with ``logprobs: k``
the ``logprobs`` object then covers the prompt's tokens first (the first one's logprob and
top alternatives null, as it has no context), then the answer's, ``text_offset`` counting on
across both. The prompt's values come from the prefill that computes its KV
(``SamplingParams.prompt_logprobs``, :mod:`pensieve.runner.prompt_logprobs`); such a request
gets a cache salt of its own, so that no shared prefix KV skips its positions. A turn of a
conversation scores its new tokens only (the history's KV is cached): the first new token's
value is null there.

Lm-evaluation-harness's loglikelihood requests are of this kind: ``echo``, ``logprobs: 1``,
``max_tokens: 1``, temperature 0.
"""

from __future__ import annotations

import uuid
from typing import Any

from pensieve.core.outputs import TokenLogprobs
from pensieve.core.sampling_params import SamplingParams
from pensieve.server.errors import APIError
from pensieve.server.logprobs import LogprobsFormatter

# ``respond`` calls this module: its ``TurnOutput`` and ``Result`` are taken as Any here (an
# import of them, even for type checking only, would close an import cycle)
TurnOutput = Any
Result = Any


def scoring_salt(params: SamplingParams, salt: str | None) -> str | None:
    """The cache salt a turn runs with: a fresh one when it scores its prompt."""
    return "prompt-logprobs-" + uuid.uuid4().hex if params.prompt_logprobs is not None else salt


def _prompt_entries(out: TurnOutput, result: Result) -> list[TokenLogprobs | None]:
    """The turn's prompt tokens' entries (the last ``len(prompt)`` of the context's)."""
    n = len(out.turn.prompt_ids)
    lps = result.prompt_logprobs or []
    return list(lps[-n:]) if len(lps) >= n else [None] * n


def echo_choice(out: TurnOutput, result: Result, choice: dict[str, Any]) -> None:
    """A completion choice with the prompt echoed (and its log-probabilities, if asked)."""
    tok = out.state.renderer.tokenizer if out.state.renderer is not None else None
    prompt_ids = out.turn.prompt_ids
    prompt = getattr(out.body, "prompt", None)
    if not isinstance(prompt, str):
        prompt = str(tok.decode(prompt_ids)) if tok is not None else ""
    choice["text"] = prompt + choice["text"]
    if out.body.num_logprobs() is None:
        return
    fmt = LogprobsFormatter(tok, chat=False)
    head = fmt.format(prompt_ids, _prompt_entries(out, result))
    if head["top_logprobs"]:
        head["top_logprobs"][0] = None  # no context: vLLM's null
    n = len(result.output_ids)
    tail = fmt.format(out.tokens[:n], out.logprobs[:n])
    choice["logprobs"] = {k: head[k] + tail[k] for k in head}



def check_echo(body: Any) -> None:
    """400s for what echo does not combine with here: a stream, and ``n`` > 1 with
    ``logprobs`` (later choices reuse the prompt's KV: their prompt would not be scored)."""
    if not body.echo:
        return
    if body.stream:
        raise APIError(400, "echo is not supported with stream", param="stream",
                       code="unsupported_parameter")
    if body.n > 1 and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs n = 1", param="n",
                       code="unsupported_parameter")
