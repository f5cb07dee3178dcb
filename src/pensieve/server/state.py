"""What the server's request handlers share: the engine, the conversation store, the chat
renderer, the settings, the preparation thread pool and the admission counters. It imports
only the parts it holds, so the modules that take it (app, turns, respond) import it without
importing one another in a circle."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pensieve.server.async_engine import EngineClient
from pensieve.server.chat import ChatRenderer
from pensieve.server.engine_ids import EngineIds
from pensieve.server.engine_metrics import Metrics
from pensieve.server.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_KEEP_ALIVE_S,
    DEFAULT_MAX_PRIORITY,
)
from pensieve.server.store_sqlite import ConversationStore
from pensieve.server.usage import Usage


@dataclass
class ServerState:
    """The server's parts and settings, one per app."""

    engine: EngineClient
    store: ConversationStore
    renderer: ChatRenderer | None
    model_name: str
    is_demo: bool
    api_keys: tuple[str, ...]
    max_model_len: int
    metrics: Metrics
    served_model_names: tuple[str, ...] = ()
    """Names a request's ``model`` may give (``model_name`` first); empty: only it."""
    model_aliases: tuple[str, ...] = ()
    """Other names a request's ``model`` may give: the model's path and directory name (vLLM
    serves a model under its path; benchmark clients send the tokenizer path)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins allowed by CORS (empty: no CORS headers)."""
    metrics_public: bool = False
    """``/metrics`` without an API key (for scrapers)."""
    metrics_key: str | None = None
    """The operator's key that reads ``/metrics`` when API keys are set (a tenant's key does
    not: it reads its own ``/v1/usage``)."""
    max_queued_requests: int | None = None
    """Requests waiting for their first token beyond which a new one gets a 429 (None: no
    limit)."""
    max_request_bytes: int = 8 * 2**20
    default_max_tokens: int | None = None
    """``max_tokens`` of a request that gives none (capped by the room left in the context;
    None: the room left, as vLLM)."""
    max_turn_tokens: int | None = None
    """Most tokens (context and answer) the engine holds for one turn (its GPU tier; None:
    ``max_model_len``): the room a default ``max_tokens`` fills."""
    extra_stop_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of ``generation_config.json``: every turn stops on them."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """``temperature``/``top_p``/``top_k`` of requests that leave them out."""
    max_priority: float = DEFAULT_MAX_PRIORITY
    """Largest ``retention_priority`` a request may set (400 past it)."""
    priority_means_retention: bool = False
    """A request's ``priority`` is the retention weight, as before vLLM's scheduling
    ``priority`` was accepted (one release; :mod:`.priority`)."""
    max_keep_alive_s: float = DEFAULT_MAX_KEEP_ALIVE_S
    """Largest ``keep_alive_s`` a request may set (400 past it)."""
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        4, thread_name_prefix="pensieve-prep"))
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    """Longest a request's grammar may compile; past it the request is a 400."""
    too_complex_grammars: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    """Grammars that ran out of compile time, refused at once when sent again."""
    engine_ids: EngineIds = field(default_factory=EngineIds)
    """The engine conversation of each API conversation (:mod:`.engine_ids`)."""
    usage: Usage = field(default_factory=Usage)
    """Each tenant's completed turns and tokens (``/v1/usage``)."""
    queued: int = 0
    """Requests accepted that have not produced their first token (being prepared, waiting
    for the engine, or in prefill)."""
    draining: bool = False
    """Shutting down: new requests get a 503."""
    corrupt_conversations: int = 0
    """Conversations the store's check at start found corrupt (each refused when asked for)."""
    store_error: str | None = None
    """Why the last write to the store failed, until a write (or ``/health``'s probe)
    succeeds again: ``/health`` reports ``degraded`` meanwhile."""

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model_name,)
