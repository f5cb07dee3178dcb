"""An in-process server over a scripted engine: the real scheduler and two-tier cache, and an
executor that answers from a script and records the KV it "computes" slot by slot.

The executor keeps a token per KV slot of both tiers and applies each step's swaps and writes,
so the context a request's first sampled token attends to is read back from the cache's own
block table: what the model would have seen, with no model in the way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pensieve.core.cache_config import CacheConfig
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import Executor, TierSizes

CHUNK = 8

TEMPLATES: dict[str, tuple[str, str, str]] = {
    # name: (chat template, bos token, eos token), as the models' tokenizer_config.json has them
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}",
        "<|endoftext|>", "<|im_end|>"),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/"
        "...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + "
        "message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
        "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + "
        "' ' + eos_token }}{% endif %}{% endfor %}",
        "<s>", "</s>"),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
        "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}",
        "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/"
        "...') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
        "{% endif %}{% endfor %}",
        "<s>", "</s>"),
}
SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "You are a helpful assistant. Hello there, how can I help you today?",
    "[INST] Tell me about memory palaces. [/INST] Memory palaces are a way to remember.",
    "user assistant system Sure thing! Okay. What else? Thanks, that is all.",
    "<<SYS>> <</SYS>> The answer is 42. Why? Because it is.",
]


def build_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer (trained here, no hub) with one model's template."""
    chat_template, bos, eos = TEMPLATES[template]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   unk_token="<unk>", chat_template=chat_template)


class ScriptedExecutor:
    """Samples ``script[i]`` as a turn's i-th token (``filler`` past the script) and records
    the KV slots it writes, applying each step's swaps to its copy of both tiers."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.script: list[int] = []
        self.filler = 0
        self.scripts: dict[int | None, list[int]] = {}
        """Scripts of requests by their sampling seed (others follow :attr:`script`)."""
        self.gpu: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}
        self.seen: list[list[int | None]] = []
        """Per request, in order: the context its first sampled token attended to."""
        self.sampled_with: dict[str, tuple[Any, Any]] = {}
        """Per request id: the sampling parameters and token history of its last sample."""
        self.computed: list[int] = []
        """Per request, in order: positions computed before its first sampled token."""
        self._computing: dict[str, int] = {}

    @property
    def tiers(self) -> TierSizes:
        return TierSizes(self.num_gpu_blocks, self.num_cpu_blocks, 0)

    def stats(self) -> dict[str, int]:
        return {"swap_in_bytes": 0, "swap_out_bytes": 0}

    def shutdown(self) -> None:
        pass

    def _block(self, tier: dict[int, list[int | None]], b: int) -> list[int | None]:
        return tier.setdefault(b, [None] * CHUNK)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        sw = sched.swaps
        for g, c in sw.swap_out_first:
            self.cpu[c] = list(self._block(self.gpu, g))
        for c, g in sw.swap_in:
            self.gpu[g] = list(self._block(self.cpu, c))
        sampled: dict[str, int] = {}
        for s in sched.requests:
            for r in s.ranges:
                for i, t in enumerate(r.token_ids):
                    p = r.start_pos + i
                    self._block(self.gpu, s.block_table[p // CHUNK])[p % CHUNK] = t
            if s.num_output_tokens == 0:
                self._computing[s.request_id] = (self._computing.get(s.request_id, 0)
                                                 + s.num_scheduled_tokens)
            if s.sample:
                self.sampled_with[s.request_id] = (s.sampling_params, s.token_history)
                if s.num_output_tokens == 0:
                    self.seen.append([self._block(self.gpu, s.block_table[p // CHUNK])[p % CHUNK]
                                      for p in range(s.context_len)])
                    self.computed.append(self._computing.pop(s.request_id))
                i = s.num_output_tokens
                script = self.scripts.get(s.sampling_params.seed, self.script)
                sampled[s.request_id] = script[i] if i < len(script) else self.filler
        for g, c in sw.swap_out:
            self.cpu[c] = list(self._block(self.gpu, g))
        return RunnerOutput(sampled_token_ids=sampled)


def scripted_engine(vocab_size: int, eos_token_ids: tuple[int, ...], num_gpu_blocks: int = 64,
                    num_cpu_blocks: int = 64, max_model_len: int = 1024,
                    wrap: Callable[[ScriptedExecutor], Executor] | None = None,
                    tenant_kv_share: float | None = None,
                    ) -> tuple[EngineCore, ScriptedExecutor]:
    """The real scheduler and two-tier cache over a :class:`ScriptedExecutor` (``wrap``: an
    executor around it, e.g. one that raises on some requests)."""
    ex = ScriptedExecutor(num_gpu_blocks, num_cpu_blocks)
    cache = TieredKVCache(num_gpu_blocks, num_cpu_blocks, lambda n: float(n),
                          CacheConfig(chunk_size=CHUNK, tenant_kv_share=tenant_kv_share,
                                      share_prefixes=False, defer_admission=0),
                          policy=get_policy("pensieve"))
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=max_model_len)
    executor: Executor = wrap(ex) if wrap is not None else ex
    return EngineCore(Scheduler(cfg, cache), executor, clock=time.monotonic,
                      eos_token_ids=eos_token_ids, vocab_size=vocab_size), ex


def scripted_app(tokenizer: Any, store: Path,
                 wrap: Callable[[ScriptedExecutor], Executor] | None = None,
                 **kw: Any) -> tuple[Any, ScriptedExecutor]:
    """A FastAPI app over a scripted engine for ``tokenizer`` (its EOS ends turns); ``kw``
    are :class:`~pensieve.server.state.ServerState` fields."""
    from pensieve.server.app import create_app
    from pensieve.server.async_engine import AsyncEngine
    from pensieve.server.chat import ChatRenderer
    from pensieve.server.engine_metrics import Metrics
    from pensieve.server.state import ServerState
    from pensieve.server.store_sqlite import ConversationStore

    eng, ex = scripted_engine(len(tokenizer), (tokenizer.eos_token_id,), wrap=wrap)
    aeng = AsyncEngine(eng)  # type: ignore[arg-type]
    fields: dict[str, Any] = {"api_keys": (), "max_model_len": 1024,
                              "max_turn_tokens": eng.scheduler.max_turn_tokens, **kw}
    state = ServerState(engine=aeng, store=ConversationStore(str(store)),
                        renderer=ChatRenderer(tokenizer), model_name="scripted", is_demo=False,
                        metrics=Metrics(aeng), **fields)
    return create_app(state), ex
