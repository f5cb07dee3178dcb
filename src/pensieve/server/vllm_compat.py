"""What vLLM's clients look for beside the OpenAI API: ``GET /tokenizer_info`` (the tokenizer's
class, special tokens, chat template and length, as vLLM serves it: lm-evaluation-harness's
remote tokenizer reads it), and ``vllm:``-named aliases of the server's metrics for dashboards
built on vLLM's names.

Aliases (each the same series as its ``pensieve_`` metric, renamed)::

    vllm:num_requests_running            pensieve_requests_running
    vllm:num_requests_waiting            pensieve_requests_waiting
    vllm:kv_cache_usage_perc             pensieve_kv_cache_usage_ratio{tier="gpu"} (0..1)
    vllm:generation_tokens_total         pensieve_generation_tokens_total
    vllm:time_to_first_token_seconds     pensieve_time_to_first_token_seconds
    vllm:e2e_request_latency_seconds     pensieve_e2e_request_latency_seconds
    vllm:request_time_per_output_token_seconds  pensieve_time_per_output_token_seconds
    vllm:inter_token_latency_seconds     pensieve_inter_token_latency_seconds
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import Metric

from pensieve.server.errors import APIError

ServerState = Any
"""``server.state.ServerState``, which imports this module through its metrics (an import
of it, even for type checking only, would close an import cycle)."""

ALIASES = {
    "pensieve_requests_running": "vllm:num_requests_running",
    "pensieve_requests_waiting": "vllm:num_requests_waiting",
    "pensieve_generation_tokens": "vllm:generation_tokens",
    "pensieve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pensieve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pensieve_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "pensieve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
}
"""``pensieve_`` metric family -> its ``vllm:`` name."""
KV_USAGE = ("pensieve_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc")
"""The GPU tier's usage, vLLM's single KV usage gauge (a fraction, as vLLM's)."""


class VllmAliases:
    """A Prometheus collector re-emitting ``sources``' families under :data:`ALIASES`."""

    def __init__(self, sources: Iterable[Any]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        for src in self.sources:
            for fam in src.collect():
                if fam.name in ALIASES:
                    yield _renamed(fam, ALIASES[fam.name], lambda s: True)
                elif fam.name == KV_USAGE[0]:
                    yield _renamed(fam, KV_USAGE[1], lambda s: s.labels.get("tier") == "gpu",
                                   drop_labels=True)

    def describe(self) -> list[Metric]:
        return []  # collected on each scrape (the engine's values are read then)


def _renamed(fam: Metric, name: str, keep: Callable[[Any], bool],
             drop_labels: bool = False) -> Metric:
    out = Metric(name, fam.documentation + " (vLLM's name)", fam.type, fam.unit)
    for s in fam.samples:
        if keep(s):
            out.add_sample(name + s.name[len(fam.name):], {} if drop_labels else s.labels,
                           s.value, s.timestamp, s.exemplar)
    return out


def add_vllm_routes(app: FastAPI, state: ServerState,
                    tenant_of: Callable[[Request], str]) -> None:
    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        """The tokenizer's class, special tokens, chat template and length (vLLM's shape)."""
        tenant_of(request)
        if state.renderer is None:
            raise APIError(404, "this model has no tokenizer", code="no_tokenizer")
        tok = state.renderer.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__,
                                "model_max_length": state.max_model_len}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                     "add_bos_token", "add_eos_token", "padding_side", "truncation_side",
                     "clean_up_tokenization_spaces"):
            value = getattr(tok, name, None)
            if isinstance(value, (str, bool, int)):
                info[name] = value
        info["vocab_size"] = len(tok)
        return info
