"""A turn's sampling parameters from its request body: stop strings and stop ids, the
``max_tokens`` that fits the context, and the :class:`SamplingParams` the engine runs with.
Every refusal is an OpenAI-shaped 400 naming the field."""

from __future__ import annotations

from pensieve.core.sampling_params import GrammarSpec, SamplingParams
from pensieve.server.errors import APIError
from pensieve.server.protocol import MIN_TEMPERATURE, _Sampling
from pensieve.server.state import ServerState

_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
                    "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "min_tokens", "min_p", "logit_bias", "priority"}
MAX_STOP_STRINGS = 64


def stop_lists(state: ServerState, body: _Sampling) -> tuple[list[str], list[int]]:
    """Stop strings matched on text, and stop ids (those that spell a special token)."""
    stops = body.stop_list()
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                       param="stop")
    texts, ids = [], list(body.stop_token_ids or [])
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"stop string is not valid Unicode text: {e.reason}",
                           param="stop") from None
        tid = state.renderer.special_token_id(s) if state.renderer else None
        if tid is not None:
            ids.append(tid)
        elif s:
            texts.append(s)
    if texts and state.renderer is None:
        raise APIError(400, "stop strings need a tokenizer: use stop_token_ids", param="stop")
    return texts, ids


def sampling_params(state: ServerState, body: _Sampling, max_tokens: int,
                    stop_ids: list[int], grammar: GrammarSpec | None = None) -> SamplingParams:
    """The engine's sampling parameters of a turn: the body's fields over the server's
    defaults (the model's ``generation_config.json``) for those the body left out; ``stop_ids`` from
    :func:`stop_lists`. A value :class:`SamplingParams` refuses is a 400 naming its field."""
    given = body.model_fields_set
    d = {k: v for k, v in state.sampling_defaults.items() if k not in given}
    stop_ids = stop_ids + [i for i in state.extra_stop_token_ids if not body.ignore_eos]
    try:
        num_logprobs = body.num_logprobs()
    except ValueError as e:
        raise APIError(400, str(e), param="top_logprobs") from e
    temperature = d.get("temperature", body.temperature)
    if 0.0 < temperature < MIN_TEMPERATURE:  # as vLLM: a smaller divisor overflows the logits
        temperature = MIN_TEMPERATURE
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              top_p=d.get("top_p", body.top_p), top_k=d.get("top_k", body.top_k),
                              seed=body.seed,
                              stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos,
                              logprobs=num_logprobs,
                              prompt_logprobs=body.num_prompt_logprobs(),
                              priority=int(body.priority),
                              presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty,
                              min_tokens=body.min_tokens, min_p=body.min_p,
                              logit_bias=tuple(body.logit_bias_ids().items()), grammar=grammar)
    except ValueError as e:  # SamplingParams names the field first in its messages
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in _SAMPLING_FIELDS else None) from e


def turn_max_tokens(state: ServerState, context_len: int, max_tokens: int | None) -> int:
    """The turn's ``max_tokens``: as asked, or without one the rest of the context (as vLLM),
    capped by what the engine holds for one turn (``state.max_turn_tokens``) and by the
    server's ``default_max_tokens``. A context or an answer
    that does not fit ``max_model_len`` is a 400 (``context_length_exceeded``)."""
    room = state.max_model_len - context_len
    if room < 1:
        raise APIError(400, f"the conversation's context ({context_len} tokens) exceeds "
                       f"max_model_len={state.max_model_len}",
                       code="context_length_exceeded", param="messages")
    if max_tokens is None:  # the rest of the context, as vLLM (or the server's cap)
        fits = (state.max_turn_tokens or state.max_model_len) - context_len
        return max(1, min(room, fits, state.default_max_tokens or room))
    if max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the room left in the context "
                       f"({room} of max_model_len={state.max_model_len})",
                       code="context_length_exceeded", param="max_tokens")
    return max_tokens
