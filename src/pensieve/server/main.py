"""Build the engine, the store and the app from command-line options, then run uvicorn."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pensieve.options import (
    COMMAND_HELP,
    add_engine_args,
    default_of,
    engine_options,
    float_or_nan,
    settle_model_options,
)
from pensieve.server.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_KEEP_ALIVE_S,
    DEFAULT_MAX_PRIORITY,
)

if TYPE_CHECKING:  # the engine is imported when it is built, not for `pensieve --help`
    from pensieve.engine.llm_engine import LLMEngine

log = logging.getLogger("pensieve.server")


DEFAULT_SWITCH_INTERVAL_MS = 0.5
"""The server's thread switch interval: the engine thread needs the GIL between the GPU's
steps while the event loop streams tokens, and a shorter interval than Python's 5 ms gives it
sooner (chosen by an A/B: docs/benchmarks.md, "Current engine: steady-state points ...", the
item "The server's host time")."""


DEFAULT_WATCHDOG_S = 300.0
"""``--watchdog-timeout``: as SGLang's. A step must never take this long; on a CPU a
4,000-token prefill step took ~30 s on a busy 2-core machine."""


def positive_ms_arg(text: str) -> float:
    """A positive, finite number of milliseconds (``--switch-interval-ms``)."""
    v = float_or_nan(text)
    if not (0.0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of ms, got {text!r}")
    return v


def seconds_arg(text: str) -> float:
    """A finite number of seconds >= 0 (``--shutdown-timeout``)."""
    v = float_or_nan(text)
    if not (0.0 <= v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return v


def positive_arg(text: str) -> float:
    """A positive, finite number (``--max-priority``)."""
    v = float_or_nan(text)
    if not (0.0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def share_arg(text: str) -> float | str:
    """``--tenant-kv-share``: a fraction in (0, 1], ``auto`` or ``off``."""
    t = text.strip().lower()
    if t in ("auto", "off"):
        return t
    v = float_or_nan(t)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], 'auto' or 'off', "
                                         f"got {text!r}")
    return v


def tenant_kv_share(arg: float | str, num_keys: int) -> float | None:
    """The share of each tier a tenant's hinted conversations may hold: ``auto`` is an equal
    share per API key with two keys or more, none with one tenant."""
    if arg == "off" or (arg == "auto" and num_keys < 2):
        return None
    return 1.0 / num_keys if arg == "auto" else float(arg)


SERVER_ENGINE_OPTIONS = ("tenant_kv_share",)
"""Engine options that ``pensieve serve`` decides with flags of its own (``--tenant-kv-share``
has an ``auto`` that counts the API keys)."""


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """``pensieve serve``'s bounds on requests: queue, body size, shutdown, retention hints."""
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for their first token beyond which new ones get "
                        "429 with Retry-After (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest request body; a larger one gets 413 (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=seconds_arg, default=30.0,
                   help="on SIGTERM/SIGINT: stop accepting, let turns in flight finish this "
                        "many seconds, then end them with an error (503 / an SSE error event, "
                        "code shutting_down; their conversations stay as they were) and exit")
    p.add_argument("--max-retention-priority", "--max-priority", dest="max_priority",
                   type=positive_arg, default=DEFAULT_MAX_PRIORITY, metavar="P",
                   help="largest retention_priority a request may set; more is a 400 "
                   f"(default {DEFAULT_MAX_PRIORITY:g}; --max-priority: its old name)")
    p.add_argument("--priority-means-retention", action="store_true",
                   help="read a request's priority as the retention weight, as before "
                   "(retention_priority's old name; for one release): by default priority is "
                   "vLLM's scheduling priority")
    p.add_argument("--max-keep-alive-s", type=seconds_arg, default=DEFAULT_MAX_KEEP_ALIVE_S,
                   metavar="S", help="largest keep_alive_s a request may set; more is a "
                   f"400 (default {DEFAULT_MAX_KEEP_ALIVE_S:g})")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The options of ``pensieve serve``: the engine's (generated from the config,
    :func:`pensieve.options.add_engine_args`) and the server's own."""
    add_engine_args(p, exclude=SERVER_ENGINE_OPTIONS, help=COMMAND_HELP)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run N engine replicas (one per GPU, or on the CPU) as a Ray Serve "
                        "application behind one endpoint, conversations routed by affinity "
                        "(needs the replicas extra: pip install -e '.[replicas]')")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 "
                        "for every interface)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port to listen on, checked before the model loads (default: 8000)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this bearer key (repeat for several tenants); "
                        "also read from PENSIEVE_API_KEYS (comma-separated)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's names in the API (the first is the one reported; a "
                        "request naming another model gets a 404)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins whose browser pages may call the API (CORS; '*' for any; "
                        "default: none)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without an API key, for Prometheus scrapers (default: "
                        "/metrics needs --metrics-key when --api-key is set)")
    p.add_argument("--metrics-key", default=os.environ.get("PENSIEVE_METRICS_KEY"),
                   metavar="KEY",
                   help="the operator's key that reads /metrics when --api-key is set (a "
                        "tenant's key reads only its own usage, at /v1/usage); also read from "
                        "PENSIEVE_METRICS_KEY (default: none, so /metrics answers 403 to every "
                        "key unless --metrics-public)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the model's own)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template text itself")
    _add_limit_args(p)
    p.add_argument("--tenant-kv-share", type=share_arg, default="auto", metavar="FRACTION",
                   help="share of each KV tier a tenant's conversations with retention hints "
                   "may hold; past it their hints stop counting and they are evicted first, so "
                   "no tenant's hints push out another's KV (auto, the default: 1/N with N >= 2 "
                   "API keys, else off; off: no bound)")
    p.add_argument("--store", default=None,
                   help="the persistent conversation store: a SQLite file, or a "
                        "postgresql:// URL (shared by replicas on several hosts) (default: "
                        "conversations.db in $PENSIEVE_CACHE_DIR, itself ~/.cache/pensieve "
                        "by default)")
    p.add_argument("--switch-interval-ms", type=positive_ms_arg,
                   default=DEFAULT_SWITCH_INTERVAL_MS, metavar="MS",
                   help="Python's thread switch interval (sys.setswitchinterval) in the server "
                        "process: how long the engine thread may wait for the GIL while the "
                        f"HTTP side holds it (default {DEFAULT_SWITCH_INTERVAL_MS}; Python's "
                        "own is 5)")
    p.add_argument("--watchdog-timeout", type=seconds_arg, default=DEFAULT_WATCHDOG_S,
                   metavar="S",
                   help="an engine that reports no progress (no step, no idle heartbeat) for "
                        "this many seconds is hung: what is in flight fails, /health answers "
                        "503 and the server exits with status 1 for its supervisor to restart "
                        f"it; longer than the longest step (default {DEFAULT_WATCHDOG_S:g}; "
                        "0: off)")
    p.add_argument("--grammar-compile-timeout", type=positive_arg,
                   default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, metavar="S",
                   help="longest a request's response_format or forced tool_choice grammar may "
                        "compile (off the engine's steps: other requests go on meanwhile); past "
                        "it the request is a 400 grammar_too_complex (default "
                        f"{DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, off the GIL of the HTTP side "
                        "(default); --no-engine-process: in a thread of the server process")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log messages of this level and above (default: info)")


class PortInUseError(Exception):
    """The address ``pensieve serve`` was asked to listen on cannot be bound."""


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, as uvicorn will bind it (``SO_REUSEADDR``: a
    port left in TIME_WAIT is free), so that a port in use is found before the model loads;
    :class:`PortInUseError` if it cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise PortInUseError(f"cannot listen on {host}:{port}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise PortInUseError(f"cannot listen on {host}:{port} ({why}); choose another "
                                 "with --port") from None


def serve(args: argparse.Namespace) -> int:
    """One server process (``--data-parallel-size`` > 1 is dispatched by ``pensieve.cli`` to
    :func:`pensieve.replicas.serve.serve_replicas`, which builds each replica with
    :func:`build_server`). The port is checked first, before anything loads."""
    from pensieve.server.shutdown import run_server

    check_port(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, close = build_server(args)
    # What was built so far lives as long as the server: the collector leaves it alone from
    # here (no full collections over torch's and the app's objects while serving, and none
    # at exit: tearing them down took ~1 s of a server's stop)
    gc.freeze()
    state = app.state.pensieve
    reason = ("the server is shutting down: the turn was not completed (its conversation is "
              "as it was before the turn)")
    try:
        code = run_server(app, args.host, args.port, args.log_level, args.shutdown_timeout,
                          lambda: state.engine.end_streams(reason), lambda: state.engine.alive)
    finally:
        close()
    return code


def default_store() -> Path:
    """``conversations.db`` in the cache directory (``$PENSIEVE_CACHE_DIR``, by default
    ``~/.cache/pensieve``): a checkout or a test run that sets its own cache directory gets a
    store of its own."""
    from pensieve.models.builtin import cache_root

    return cache_root() / "conversations.db"


def model_aliases(model: str, path: Any) -> tuple[str, ...]:
    """Names of the model besides its served names: the argument as given, its resolved
    directory, and their last components (``/models/Qwen3-8B`` also answers to ``Qwen3-8B``)."""
    names = [model, Path(model).name]
    if path is not None:
        names += [str(path), Path(path).name]
    return tuple(dict.fromkeys(n for n in names if n))


def _spawn_engine(args: argparse.Namespace, start_method: str = "spawn") -> Any:
    """With ``--engine-process``, the engine's process (it waits for its config); None
    otherwise."""
    if not args.engine_process:
        return None
    from pensieve.server.engine_process import ProcessEngine

    return ProcessEngine(None, args.log_level,
                         getattr(args, "watchdog_timeout", DEFAULT_WATCHDOG_S) or None,
                         start_method=start_method)


def _forks_engine(args: argparse.Namespace) -> bool:
    """Whether the engine's process is forked from this one once the config is settled
    (torch and transformers imported here then: the engine's process does not import them
    again, ~2.5 s of CPU) rather than spawned first, to import them beside this process: a
    CPU engine from a process with no other thread. CUDA is initialised only in the
    engine's process (a forked one would inherit a broken context), and a process with
    threads (a Ray replica's, a test's) is not forked."""
    device = str(engine_options(args).get("device") or default_of("device"))
    if device == "auto":  # the CPU unless torch was built for a GPU (asked without CUDA)
        device = "cpu" if not _torch_built_for_gpu() else "auto"
    return (args.engine_process and device.split(":")[0] == "cpu"
            and threading.active_count() == 1)


def _torch_built_for_gpu(version_py: Path | None = None) -> bool:
    """Whether the installed torch (``version_py``: its ``version.py``, found when None) was
    built with CUDA or ROCm, read from that file without importing torch or asking a driver
    (a forked child of a process that asked would inherit that state): ``--device auto`` is
    the CPU on a build without either."""
    import ast
    from importlib.util import find_spec

    if version_py is None:
        spec = find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        version_py = Path(spec.submodule_search_locations[0]) / "version.py"
    try:
        tree = ast.parse(version_py.read_text())
    except (OSError, SyntaxError):
        return True  # unknown: as a GPU build (spawned, as before)
    target: ast.expr
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if (isinstance(target, ast.Name) and target.id in ("cuda", "hip")
                and not (isinstance(value, ast.Constant) and value.value is None)):
            return True
    return False


def _start_engine(cfg: Any, args: argparse.Namespace, spawned: Any
                  ) -> tuple[LLMEngine | None, Any]:
    """(the engine if it lives in this process, the client the server talks to), once the
    engine is built: in ``spawned`` (:func:`_spawn_engine`, its config already sent) or in
    a thread of this process."""
    if spawned is not None:
        from pensieve.threads import settle_server_threads

        spawned.wait_ready()
        settle_server_threads(spawned.info["device"])  # after the engine took its CPUs
        return None, spawned
    from pensieve.engine.llm_engine import LLMEngine
    from pensieve.server.async_engine import AsyncEngine

    engine = LLMEngine(cfg)
    return engine, AsyncEngine(engine, getattr(args, "watchdog_timeout", DEFAULT_WATCHDOG_S)
                               or None)


def _engine_config(args: argparse.Namespace, keys: list[str]) -> tuple[dict[str, Any], Any, Any]:
    """The engine's options settled from the model, the model's directory and the config."""
    from pensieve.engine.llm import build_engine_config

    share = tenant_kv_share(args.tenant_kv_share, len(keys))
    # the server's --tenant-kv-share decides, over a config file's value too
    opts = {**engine_options(args, exclude=SERVER_ENGINE_OPTIONS), "tenant_kv_share": share}
    _, path = settle_model_options(opts)
    if opts.get("max_num_batched_tokens") is not None:
        opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], 1)
    return opts, path, build_engine_config(**opts)


def build_server(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    """The engine, the store and the FastAPI app from the options; returns the app and the
    function that stops them (also what each replica of ``--data-parallel-size`` runs). Once
    the store is open the engine's process is spawned, and it imports torch and the engine
    while this process settles the config; or, for a CPU engine, it is forked once the config
    is settled (:func:`_forks_engine`). This process loads the tokenizer while the engine is
    built."""
    from pensieve.server.store_check import open_checked

    if args.store is None:
        args.store = str(default_store())
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("PENSIEVE_API_KEYS", "").split(",") if k.strip()]
    # the store first: one that cannot be used stops the server before the engine starts
    store, report = open_checked(args.store)
    fork = _forks_engine(args)
    spawned = None
    try:
        if not fork:  # started now: it imports torch and the engine beside this process
            spawned = _spawn_engine(args)
        opts, path, cfg = _engine_config(args, keys)
        if fork:  # unless settling the config started a thread here
            spawned = _spawn_engine(args, "fork" if threading.active_count() == 1 else "spawn")
        if spawned is not None:
            spawned.configure(cfg)
        front = _front(args, opts["model"], path)  # while the engine builds
        engine, aengine = _start_engine(cfg, args, spawned)
    except BaseException:
        if spawned is not None:
            spawned.shutdown()
        store.close()
        raise
    try:
        app, close = _assemble(args, front, opts["max_model_len"], engine, aengine, store,
                               report, keys)
    except BaseException:
        aengine.shutdown()
        if engine is not None:
            engine.shutdown()
        store.close()
        raise
    sys.setswitchinterval(args.switch_interval_ms / 1e3)  # here, not in a forked engine
    return app, close


@dataclass(frozen=True)
class _Front:
    """What the server needs of the model apart from the engine: its names, its chat
    renderer (None without a tokenizer) and its generation defaults."""

    model: str
    path: Any
    demo: bool
    names: tuple[str, ...]
    renderer: Any
    eos_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]


def _front(args: argparse.Namespace, model: str, path: Any) -> _Front:
    from pensieve.models.demo import is_demo
    from pensieve.models.tokenizer import load_tokenizer
    from pensieve.server.chat import ChatRenderer
    from pensieve.server.model_defaults import generation_defaults

    demo = is_demo(path)
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    try:
        renderer = ChatRenderer(load_tokenizer(args.tokenizer or path or model), template)
    except ValueError as e:
        log.warning("no tokenizer (%s): /v1/chat/completions is off, token-id prompts only", e)
        renderer = None
    eos_ids, sampling_defaults = generation_defaults(path)
    names = tuple(args.served_model_name or
                  ["pensieve-demo" if demo else Path(model).name])
    if demo:
        log.warning("serving the built-in DEMO model: random weights, answers are noise")
    return _Front(model, path, demo, names, renderer, tuple(eos_ids), sampling_defaults)


def _assemble(args: argparse.Namespace, front: _Front, max_len: int, engine: LLMEngine | None,
              aengine: Any, store: Any, report: Any, keys: list[str]
              ) -> tuple[Any, Callable[[], None]]:
    """The app over a started engine and an open store, and the function that stops them."""
    from pensieve.server.app import create_app
    from pensieve.server.engine_metrics import Metrics
    from pensieve.server.state import ServerState

    turn_tokens = (aengine.info["max_turn_tokens"] if engine is None
                   else engine.scheduler.max_turn_tokens)
    model, path, names = front.model, front.path, front.names
    state = ServerState(aengine, store, front.renderer, names[0], front.demo, tuple(keys), max_len,
                        Metrics(aengine), served_model_names=names,
                        model_aliases=model_aliases(model, path),
                        max_turn_tokens=turn_tokens,
                        allowed_origins=tuple(args.allowed_origins or ()),
                        metrics_public=args.metrics_public, metrics_key=args.metrics_key,
                        max_queued_requests=args.max_queued_requests,
                        max_request_bytes=args.max_request_bytes,
                        extra_stop_token_ids=front.eos_ids,
                        sampling_defaults=front.sampling_defaults,
                        corrupt_conversations=len(report.corrupt),
                        max_priority=args.max_priority,
                        priority_means_retention=getattr(args, "priority_means_retention",
                                                         False),
                        max_keep_alive_s=args.max_keep_alive_s,
                        grammar_compile_timeout_s=getattr(
                            args, "grammar_compile_timeout", DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S))
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
