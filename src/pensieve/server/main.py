"""Build the engine, the store and the app from command-line options, then run uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from pensieve.engine.llm import build_engine_config
from pensieve.engine.llm_engine import LLMEngine

log = logging.getLogger("pensieve.server")


def swap_bandwidth_arg(text: str) -> float | str:
    """``--swap-bandwidth-gbps``: a positive number of GB/s, ``auto`` or ``off``."""
    t = text.strip().lower()
    if t in ("auto", "off"):
        return t
    if t == "none":
        return "off"
    try:
        v = float(t)
    except ValueError:
        v = float("nan")
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of GB/s, 'auto' or 'off', got {text!r}")
    return v


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="demo",
                   help="HF checkpoint directory (default: the built-in random-weight demo)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require this bearer key (repeat for several tenants); "
                        "also read from PENSIEVE_API_KEYS (comma-separated)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--store", default=str(Path.home() / ".cache" / "pensieve" / "conversations.db"),
                   help="SQLite file of the persistent conversation store")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices (worker process per rank)")
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
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--batching", default="unified", choices=["unified", "separate"],
                   help="unified: prefill and decode tokens share each step (default); "
                        "separate: a step runs prefills or decodes, not both")
    p.add_argument("--log-level", default="info")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pensieve.models.demo import is_demo
    from pensieve.models.loader import resolve_config
    from pensieve.models.tokenizer import load_tokenizer
    from pensieve.server.app import ServerState, create_app
    from pensieve.server.async_engine import AsyncEngine
    from pensieve.server.chat import ChatRenderer
    from pensieve.server.metrics import Metrics
    from pensieve.server.store import ConversationStore

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("PENSIEVE_API_KEYS", "").split(",") if k.strip()]
    max_len = args.max_model_len
    cfg = build_engine_config(
        model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        cuda_graph_mixed=args.mixed_graphs, chunk_size=args.chunk_size,
        gpu_kv_gb=args.gpu_kv_gb, num_gpu_blocks=args.num_gpu_blocks,
        cpu_kv_gb=args.cpu_kv_gb, num_cpu_blocks=args.num_cpu_blocks,
        cache_policy=args.cache_policy, max_model_len=max_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
        max_num_seqs=args.max_num_seqs, batching=args.batching,
    )
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(
        cfg.cache, swap_bandwidth_gbps=args.swap_bandwidth_gbps))
    engine = LLMEngine(cfg)
    _, path = resolve_config(args.model)
    demo = is_demo(path)
    try:
        renderer = ChatRenderer(load_tokenizer(path or args.model))
    except ValueError as e:
        log.warning("no tokenizer (%s): /v1/chat/completions is off, token-id prompts only", e)
        renderer = None
    name = args.served_model_name or ("pensieve-demo" if demo else Path(args.model).name)
    if demo:
        log.warning("serving the built-in DEMO model: random weights, answers are noise")
    Path(args.store).parent.mkdir(parents=True, exist_ok=True)
    store = ConversationStore(args.store)
    aengine = AsyncEngine(engine)
    state = ServerState(aengine, store, renderer, name, demo, tuple(keys), max_len,
                        Metrics(aengine))
    app = create_app(state)
    log.info("store %s (%d conversations); auth %s", args.store, store.count(),
             f"{len(keys)} key(s)" if keys else "off")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        aengine.shutdown()
        engine.shutdown()
        store.close()
    return 0
