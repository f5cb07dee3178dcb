"""Executes one SchedulerOutput on a device: build inputs, run the model, sample.

Device-agnostic: on CUDA the attention runs the Triton kernels, on the CPU the pure-torch
references; everything else is the same code. Inputs are built on the host with plain Python
lists, then copied to the device in one go (pinned, non-blocking on CUDA), before the step's
swaps are issued, so that these copies on the compute stream do not queue behind them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pensieve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pensieve.engine.kv_layout import KVLayout
from pensieve.kernels import triton_on
from pensieve.kernels.launch_policy import (
    DECODE_SPAN_MODE,
    MIXED_DECODES,
    decode_kv_splits,
    decode_split_span,
    is_long_decode,
    use_split_span,
)
from pensieve.layers.attention import AttentionMetadata, first_attention
from pensieve.runner.cuda_graph import DecodeGraphs
from pensieve.runner.grammar import GrammarCompiler, GrammarSampling
from pensieve.runner.graph_waits import GraphLayerWaits, wait_layers
from pensieve.runner.mixed_graphs import MixedGraphs
from pensieve.runner.prompt_logprobs import PromptLogprobs
from pensieve.runner.sampler import sample_tensor, token_logprobs
from pensieve.runner.step_layout import RangeLayout, range_layout
from pensieve.runner.swapper import KVSwapper

if TYPE_CHECKING:
    from pensieve.kernels.fp8_scratch import Fp8Scratch

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Flattened batch of one step (all tensors on the runner's device)."""

    input_ids: torch.Tensor
    """``[T]`` int64 token ids."""
    positions: torch.Tensor
    """``[T]`` int64 position of each token in its request."""
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    """``[S]`` int64 index into ``T`` of the token each sampled request samples from."""
    layout: RangeLayout | None = None
    """The step's ranges (host arrays), for prompt log-probabilities."""


GRAPH_SWAP_IN_WAIT_S = 3e-3
"""The longest wait for swap-ins worth a graph replay: an eager step with prefill costs more
host time than its graph (docs/performance_history.md, "Steps with prefill tokens: mixed-step CUDA
graphs")."""
SWAP_GBPS = 47.0
"""The swap-in rate the runner plans with, GB/s: the swap kernel's, random block ids, as
``pensieve bench swaps`` measured it (docs/performance_history.md, "Swaps between the GPU and CPU
tiers")."""


def graph_max_swap_in(chunk_bytes: int) -> int:
    """The most swap-in chunks of ``chunk_bytes`` (all layers) a step may have and still
    replay a CUDA graph: about ``GRAPH_SWAP_IN_WAIT_S`` of copying at ``SWAP_GBPS``."""
    return max(1, int(GRAPH_SWAP_IN_WAIT_S * SWAP_GBPS * 1e9 / max(1, chunk_bytes)))


class ModelRunner:
    """Owns the model and its KV caches on one device."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        num_cpu_blocks: int = 0,
        swap_method: str | None = None,
        background_swap_out: bool | None = None,
        tokenizer: str | None = None,
    ) -> None:
        """``layout``: the engine's KV layout; ``kv_caches``: its tensors on the device
        (:meth:`KVLayout.allocate`), checked against it by the swapper, which takes its
        shapes, dtype and bytes per chunk from it. ``swap_method``: the swapper's
        (``"staged"``, ``"dma"``; None: its default, staged on CUDA).
        ``background_swap_out``: let background swap-outs outlive their step (reported in
        :attr:`RunnerOutput.swap_outs_in_flight`); None: yes, except under a multi-rank
        ``torch.distributed`` group (tensor parallelism), where only rank 0's count reaches
        the scheduler while every rank's copies must be done before it reuses the blocks.
        ``tokenizer``: where constrained requests' tokenizer loads from (a model path or
        name); None: grammar-constrained requests fail."""
        self.model = model
        self._tokenizer = tokenizer
        self.grammar: GrammarSampling | None = None
        """Matchers of constrained requests, built with the first one (:mod:`.grammar`)."""
        self._grammar_lock = threading.Lock()
        """Guards building :attr:`grammar` (the step loop, or a compile ahead of a request)."""
        self.prompt_logprobs = PromptLogprobs()
        """Prompt log-probabilities, from the prefill's own hidden states."""
        self.layout = layout
        """The KV layout (chunk shape, dtype, bytes per chunk), resolved once per engine."""
        self.kv_caches = kv_caches
        self.chunk_size = layout.chunk_size
        self.device = kv_caches[0].device
        self._pin = self.device.type == "cuda"
        if background_swap_out is None:
            background_swap_out = not _multi_rank()
        # The attention kernels compile while the CPU tier is page-locked (on an H200 the
        # 60 GB tier's locking then added nothing to the compile: docs/long_context.md)
        compiling = None
        if self.device.type == "cuda":
            pool = ThreadPoolExecutor(1)
            compiling = pool.submit(self._compile_attention)
            pool.shutdown(wait=False)
        self.swapper = KVSwapper(layout, kv_caches, num_cpu_blocks, swap_method,
                                 background=background_swap_out)
        if compiling is not None:
            compiling.result()
        self.decode_span_mode = DECODE_SPAN_MODE
        """When decode steps split KV by span (:data:`~pensieve.kernels.launch_policy.
        DECODE_SPAN_MODE`)."""
        self.mixed_decodes = MIXED_DECODES
        """How steps with prefill attend for their decodes
        (:data:`~pensieve.kernels.launch_policy.MIXED_DECODES`)."""
        self.decode_graphs: DecodeGraphs | None = None
        """Replays decode-only steps from CUDA graphs once :meth:`enable_decode_graphs` ran."""
        self.mixed_graphs: MixedGraphs | None = None
        """Replays the other steps that fit from CUDA graphs once :meth:`enable_mixed_graphs`
        ran."""
        self.graph_max_swap_in = graph_max_swap_in(layout.block_bytes)
        """Steps with more swap-ins than this replay no graph without per-group waits (the
        decode graphs; mixed-step graphs captured on CUDA have them): such a replay waits for
        every layer's swap-ins before its first layer (about ``GRAPH_SWAP_IN_WAIT_S`` at the
        swap kernel's rate), which costs more than the eager step's launch time."""
        self.num_graph_steps = 0
        """Steps run through :attr:`decode_graphs` so far."""
        self.num_span_graph_steps = 0
        """Of those, the steps whose attention split KV by span (ragged ones, by default)."""
        self.num_mixed_graph_steps = 0
        """Steps run through :attr:`mixed_graphs` so far."""

    def _compile_attention(self) -> None:
        from pensieve.kernels.fp8_scratch import compile_fp8_scratch
        from pensieve.kernels.launch import compile_attention_kernels

        attn = first_attention(self.model)
        if attn is None:
            return
        t0 = time.perf_counter()
        torch.cuda.set_device(self.device)  # this thread's current device
        c = self.kv_caches[0]
        dtype = next(self.model.parameters()).dtype
        n = compile_attention_kernels(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                      self.chunk_size, dtype, self.device, kv_dtype=c.dtype)
        if c.dtype == torch.float8_e4m3fn:  # prefill-heavy steps attend over a 16-bit scratch
            n += compile_fp8_scratch(attn.num_kv_heads, attn.head_dim, self.chunk_size, dtype,
                                     self.device)
            n += compile_attention_kernels(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                           self.chunk_size, dtype, self.device, spans=False)
        log.info("compiled %d attention kernel variants in %.1f s", n, time.perf_counter() - t0)

    def capture_graphs(self, decode_shape: tuple[int, int] | None,
                       mixed_shape: tuple[int, int, int] | None) -> None:
        """Capture the CUDA graphs of ``EngineConfig.decode_graph_shape`` /
        ``mixed_graph_shape`` (None: that kind not at all), logging how long each took."""
        for kind, shape, enable in (("decode", decode_shape, self.enable_decode_graphs),
                                    ("mixed-step", mixed_shape, self.enable_mixed_graphs)):
            if shape is not None:
                t0 = time.perf_counter()
                enable(*shape)
                log.info("captured %s CUDA graphs %s in %.1f s", kind, shape,
                         time.perf_counter() - t0)

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, capture: bool = True) -> None:
        """Capture decode steps of up to ``max_batch`` requests and ``max_blocks`` blocks each:
        with the launcher's splits and split by span (:attr:`decode_span_mode`)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.chunk_size,
                                          max_batch, max_blocks, capture=capture,
                                          span_mode=self.decode_span_mode)

    def enable_mixed_graphs(self, max_tokens: int, max_ranges: int, max_blocks: int,
                            capture: bool = True) -> None:
        """Capture steps of up to ``max_tokens`` tokens in ``max_ranges`` query ranges; on
        CUDA with the swapper's streams, with per-group swap-in waits
        (:mod:`pensieve.runner.graph_waits`), so steps with any number of swap-ins replay."""
        waits = None
        sw = self.swapper
        if capture and sw.num_cpu_blocks > 0:  # captured: on CUDA
            waits = GraphLayerWaits(wait_layers(sw.method, sw.num_layers, sw.in_groups),
                                    self.device)
        self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, self.chunk_size, max_tokens,
                                        max_ranges, max_blocks, capture=capture,
                                        layer_waits=waits, decodes=self.mixed_decodes,
                                        span_mode=self.decode_span_mode)

    def _upload(self, arrays: list[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        """Host lists onto the device: pinned non-blocking copies."""
        return [_pinned(data, dt, self._pin).to(self.device, non_blocking=True)
                for data, dt in arrays]

    def _read_tokens(self, tokens: torch.Tensor) -> list[int]:
        """The sampled tokens on the host (waits for the compute stream's work so far)."""
        return tokens.tolist()

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled ranges into token, position, slot and range arrays. With
        :attr:`mixed_decodes` ``split``, a step with one-token ranges (decodes) and longer
        ones puts the decodes' tokens first and gives them a decode launch of their own
        (``AttentionMetadata.decode``)."""
        num_ranges = sum(len(s.ranges) for s in sched.requests)
        dec_lens = sched.decode_kv_lens()  # a decode launch's: ragged ones split by span
        by_span = bool(dec_lens) and use_split_span(dec_lens, self.decode_span_mode)
        split = self.mixed_decodes == "split" and by_span and len(dec_lens) < num_ranges
        items, num_dec = sched.ranges_in_order(decodes_first=split)
        max_blocks = max(len(s.block_table) for s in sched.requests)
        tables = np.zeros((len(sched.requests), max_blocks), dtype=np.int32)
        lay = range_layout(sched, items, tables, self.chunk_size)
        qsl = np.concatenate(([0], lay.ends))
        max_q = int(lay.qlens[num_dec:].max())  # the decode launch's apart
        d = num_dec
        i64, i32 = torch.int64, torch.int32
        arrays = [(lay.slots, i64), (qsl[d:], i32), (lay.starts[d:], i32), (lay.req[d:], i32),
                  (tables.ravel(), i32), (lay.ids, i64), (lay.positions, i64), (lay.rows, i64)]
        if split:
            arrays += [(qsl[: d + 1], i32), (lay.starts[:d], i32), (lay.req[:d], i32)]
        splits = 0
        long = is_long_decode(dec_lens)  # a decode launch's tile and split class
        if by_span and (split or max_q == 1):  # a decode launch, split by span
            hkv = self.kv_caches[0].shape[-2]
            splits = decode_kv_splits(len(dec_lens), hkv, self.device, long)
            arrays.append(([decode_split_span(dec_lens, hkv, self.device)], i32))
        t = self._upload(arrays)
        tables_t = t[4].view(len(sched.requests), -1)
        attn = AttentionMetadata(
            slot_mapping=t[0], query_start_loc=t[1], range_start_pos=t[2], range_table=t[3],
            block_tables=tables_t, max_query_len=max_q,
        )
        dec = attn
        if split:
            dec = attn.decode = AttentionMetadata(
                slot_mapping=t[0], query_start_loc=t[8], range_start_pos=t[9],
                range_table=t[10], block_tables=tables_t, max_query_len=1)
        if split or max_q == 1:
            dec.long_context = long
        if splits:
            dec.num_kv_splits = splits
            dec.kv_split_span = t[-1]
        attn.fp8_scratch = self._fp8_scratch(lay.starts[d:], lay.qlens[d:], lay.req[d:], tables)
        return StepInputs(input_ids=t[5], positions=t[6], attn=attn, logits_indices=t[7],
                          layout=lay)

    def _fp8_scratch(self, starts: np.ndarray, qlens: np.ndarray, rows: np.ndarray,
                     tables: np.ndarray) -> Fp8Scratch | None:
        """An FP8 cache's scratch plan of an eager step's main launch (its decodes, when they
        attend apart, read FP8 directly), if the cost rule picks it; graph replays never use
        one (their launches are captured with the direct kernel)."""
        if self.kv_caches[0].dtype != torch.float8_e4m3fn or not triton_on(self.device):
            return None
        attn = first_attention(self.model)
        if attn is None:
            return None
        from pensieve.kernels.fp8_scratch import plan_fp8_scratch

        elem = next(self.model.parameters()).element_size()  # the scratch has q's dtype
        return plan_fp8_scratch(starts, qlens, rows, tables, self.chunk_size, attn.num_heads,
                                attn.num_kv_heads, attn.head_dim, elem, self.device)

    def _graphs_for(self, sched: SchedulerOutput) -> DecodeGraphs | MixedGraphs | None:
        """The graphs that replay the step, if any: a graph without per-group waits only when
        the step's swap-ins are few (:attr:`graph_max_swap_in`)."""
        if self.prompt_logprobs.wanted(sched.requests):
            return None  # the prompt rows' hidden states are read eagerly
        few = len(sched.swaps.swap_in) <= self.graph_max_swap_in
        if few and self.decode_graphs is not None and self.decode_graphs.can_run(sched):
            return self.decode_graphs
        mixed = self.mixed_graphs
        if (mixed is not None and (few or mixed.layer_waits is not None)
                and mixed.can_run(sched)):
            return mixed
        return None

    def _fill_grammar(self, sched: SchedulerOutput, sampled: list[ScheduledRequest]) -> bool:
        """Start compiling new requests' grammars and fill the bitmask rows of the step's
        constrained rows; True if any. Called after the forward is launched: on a GPU this
        host work overlaps it."""
        if self.grammar is None:
            if not any(s.sampling_params.grammar is not None for s in sched.requests):
                return False
            self.grammar_compiler()
        assert self.grammar is not None
        self.grammar.prepare(sched.requests, sched.finished_request_ids)
        return self.grammar.fill(sampled)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler whose cache this runner's matchers are built from (built on first
        use): a grammar compiled here ahead of its request (the server does, off the step
        loop) makes the request's compile at its first step a cache hit."""
        with self._grammar_lock:
            if self.grammar is None:
                self.grammar = self._new_grammar()
            return self.grammar.compiler

    def _new_grammar(self) -> GrammarSampling:
        if self._tokenizer is None:
            raise ValueError("this engine has no tokenizer: grammar-constrained decoding needs one")
        from pensieve.models.tokenizer import load_tokenizer

        vocab = getattr(self.model, "vocab_size", None)
        return GrammarSampling(GrammarCompiler(load_tokenizer(self._tokenizer), vocab))

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledRequest],
                constrained: bool) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """The step's tokens (grammar masks applied first) and the logprobs asked for."""
        if constrained:
            assert self.grammar is not None
            self.grammar.apply(logits)
        params = [s.sampling_params for s in sampled]
        tokens = self._read_tokens(sample_tensor(
            logits, params, [s.num_output_tokens for s in sampled],
            [s.token_history for s in sampled],
        ))  # waits for the compute stream
        if constrained:
            assert self.grammar is not None
            self.grammar.accept(sampled, tokens)
        # from the same logits (a graph replay's output buffer is not reused before this)
        logprobs = {sampled[i].request_id: lp
                    for i, lp in token_logprobs(logits, params, tokens).items()}
        return tokens, logprobs

    @torch.inference_mode()
    def _inputs(self, sched: SchedulerOutput, graphs: Any) -> tuple[Any, Any]:
        """The step's inputs: a graph's filled bucket, or the eager step's prepared inputs.
        Should preparing them raise, the step's copies run all the same (the cache planned
        them, and a block's recorded place must stay true whatever the step's compute does)."""
        try:
            if graphs is not None:
                return graphs.fill(sched), None
            return None, self.prepare_inputs(sched)
        except Exception:
            self.swapper.start_step(sched.swaps)
            self.swapper.finish_step()
            raise

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step: the step's swaps (pipelined with the layers), the model, sampling.

        The step's urgent swap-outs and swap-ins have finished when this returns; background
        swap-outs may still run (:attr:`RunnerOutput.swap_outs_in_flight`). A step without
        requests waits for every copy in flight and reports 0."""
        t0 = time.perf_counter()
        if not sched.requests:
            self.swapper.start_step(sched.swaps)
            self.swapper.finish_step()
            dt = time.perf_counter() - t0
            return RunnerOutput(sampled_token_ids={}, step_time_s=dt, swap_outs_in_flight=0,
                                host_prepare_s=dt, host_issue_s=dt)
        sampled = [s for s in sched.requests if s.sample]
        self.prompt_logprobs.forget(sched.finished_request_ids)
        prompt_lps: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        graphs = self._graphs_for(sched)
        # The step's inputs go up before its swaps are issued: copies on the compute stream
        # queue on the copy engines behind the swap copies issued before them, and layer 0
        # would wait for the last swap-in.
        bucket, inp = self._inputs(sched, graphs)
        # a graph step issues its copies ahead and background swap-outs once its forward is
        # launched (defer_background): their host time then overlaps the forward
        layer_ready = self.swapper.start_step(
            sched.swaps, defer_background=graphs is not None)
        logits: torch.Tensor | None = None
        split_span = False
        if graphs is not None:
            if layer_ready is not None:
                waits = graphs.layer_waits if graphs is self.mixed_graphs else None
                if waits is not None:  # the graph's layers wait for their groups
                    waits.arm(layer_ready)
                else:  # a graph without waits: wait for all before its first layer
                    layer_ready(len(self.kv_caches) - 1)
            t_prepared = time.perf_counter()
            out = graphs.replay(sched, bucket)
            logits = out if sampled else None
            if graphs is self.decode_graphs:
                self.num_graph_steps += 1
                split_span = graphs.split_span
                self.num_span_graph_steps += split_span
            else:
                self.num_mixed_graph_steps += 1
        else:
            inp.attn.layer_ready = layer_ready
            split_span = inp.attn.kv_split_span is not None
            t_prepared = time.perf_counter()
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn)
            if self.prompt_logprobs.wanted(sched.requests):
                lay = inp.layout
                prompt_lps = self.prompt_logprobs.compute(
                    self.model, hidden, sched.requests, lay.req, lay.starts, lay.ends,
                    lay.qlens, lay.ids)
            if sampled:
                logits = self.model.compute_logits(hidden[inp.logits_indices])
        t_issued = time.perf_counter()
        self.swapper.issue_background()  # what start_step deferred, if anything
        # host work while the device runs the forward just launched (on CUDA)
        constrained = self._fill_grammar(sched, sampled)
        tokens: list[int] = []
        logprobs: dict[str, TokenLogprobs] = {}
        if logits is not None:
            tokens, logprobs = self._sample(logits, sampled, constrained)
        elif self.device.type == "cuda":
            # the compute stream only: a device-wide sync would wait for background copies
            torch.cuda.current_stream(self.device).synchronize()
        in_flight = self.swapper.end_step()
        return RunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(sampled, tokens)},
            step_time_s=time.perf_counter() - t0,
            swap_outs_in_flight=in_flight,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            host_prepare_s=t_prepared - t0,
            host_issue_s=t_issued - t0,
            decode_split_span=split_span,
            graph_replay=graphs is not None and graphs.captured,
        )


def _pinned(data: Any, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``data`` (a list or a numpy array) in a new host tensor of ``dtype``, page-locked if
    ``pin`` (``torch.tensor`` cannot pin what it builds from a numpy array)."""
    a = np.asarray(data)
    t = torch.empty(a.shape, dtype=dtype, pin_memory=pin)
    t.numpy()[...] = a
    return t


def _multi_rank() -> bool:
    """Whether this process is one rank of a multi-rank ``torch.distributed`` group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
