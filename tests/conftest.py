"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

TINY_LLAMA_VOCAB = 256


CACHE_ENV = "PENSIEVE_TEST_CACHE_DIR"
"""The test run's cache directory (made by the first pytest process, inherited by xdist's
workers): ``$PENSIEVE_CACHE_DIR`` of every test and of the servers they start."""
_OWNS_CACHE = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    """Without CUDA, Triton kernels run through the interpreter. Chosen here only, before any
    test module imports ``pensieve.kernels``: a kernel module imported before the variable is
    set keeps compiled kernels (each kernel test module used to set it and reload its kernel
    module, and ``test_mixed_splits.py`` still failed when run right after
    ``test_mixed_fill.py``).

    Tests write only to temporary directories: ``$PENSIEVE_CACHE_DIR`` (built-in models, the
    default conversation store) is one temporary directory for the whole run, shared by
    xdist's workers, so the default model is dequantized once per run (not once per module
    that serves it) and nothing lands in ``~/.cache/pensieve``."""
    import os
    import tempfile

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if CACHE_ENV not in os.environ:  # the first pytest process of this run
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="pensieve-test-cache-")
        config.stash[_OWNS_CACHE] = True
    os.environ["PENSIEVE_CACHE_DIR"] = os.environ[CACHE_ENV]
    config.pluginmanager.register(_LongFirst(), "pensieve-long-first")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's cache directory goes with the process that made it."""
    import os
    import shutil

    if config.stash.get(_OWNS_CACHE, False):
        shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A random Llama (vocab 256, hidden 64, 2 layers, 4 query / 2 KV heads, seed 0) saved as
    safetensors: its directory and the HF model (eval mode) to compare greedy tokens with.
    torch and transformers are imported here, not when the tests are collected."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=TINY_LLAMA_VOCAB, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="session")
def smollm2_cache() -> Any:
    """The run's cache directory (a ``Path``) with the default model dequantized in it, once
    per test process (a second process finding it converted reads it)."""
    import os
    from pathlib import Path

    from server_util import run_cache_lock

    from pensieve.models.builtin import ensure_smollm2_checkpoint

    with run_cache_lock():
        ensure_smollm2_checkpoint()
    return Path(os.environ["PENSIEVE_CACHE_DIR"])


@pytest.fixture(scope="session")
def smollm2_server(smollm2_cache: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One ``pensieve serve`` of the default model (``--max-model-len 2048``, otherwise its
    default settings) for every module of this test process that talks to it (tools, peer
    clients, the default model's answers, the Responses API, vLLM's fields and clients,
    lm-eval): started once instead of once per module."""
    from server_util import Server

    from pensieve.config import DEFAULT_MODEL

    srv = Server(tmp_path_factory.mktemp("smollm2") / "conv.db", smollm2_cache,
                 "--max-model-len", "2048", model=DEFAULT_MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def fresh_chunk16(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A demo-model ``pensieve serve`` with ``--chunk-size 16`` and no shared tier: the greedy
    answers that test_remote_tier.py and test_remote_faults.py compare with, one server for
    both modules of a test process (they ask it about conversations of their own)."""
    from server_util import Server, run_cache

    srv = Server(tmp_path_factory.mktemp("fresh") / "conv.db", run_cache(), "--chunk-size", "16")
    yield srv
    srv.stop()


@pytest.fixture
def pensieve_server(tmp_path: Any) -> Any:
    """A factory of ``pensieve serve`` subprocesses (demo model, CPU, small tiers, a free port;
    ``server_util.Server``) taking extra command-line arguments; each is stopped at the end."""
    from server_util import Server, run_cache

    servers: list[Any] = []

    def start(*extra: str) -> Any:
        n = len(servers)
        servers.append(Server(tmp_path / f"conv{n}.db", run_cache(), *extra))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


SLOW_MODULES = (
    "test_default_model.py",  # SmolLM2: GGUF conversion, HF comparisons, a served chat
    "test_server.py",  # pensieve serve subprocesses
    "test_server_fuzz.py",  # ~520 bad requests against a live server
    "test_stateful_invariant.py",  # hypothesis workloads on a real engine under every policy
    "test_tensor_parallel.py",  # two-rank process groups
)
SLOW_FIXTURES = ("server", "pensieve_server", "smollm2_server", "cluster", "fresh_chunk16")
"""Tests that start a ``pensieve serve`` subprocess through these fixtures, or (``cluster``,
test_replicas.py) a local Ray cluster serving two engine replicas."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark as ``slow`` the modules and server-backed tests above (``scripts/check.sh --fast``
    leaves them out; CI runs everything)."""
    for item in items:
        if item.path.name in SLOW_MODULES or any(
                f in getattr(item, "fixturenames", ()) for f in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)


LONG_GROUPS: tuple[tuple[tuple[str, ...], int], ...] = (
    # modules sharing conftest's smollm2_server: one worker, so one default-model server
    (("test_default_model.py", "test_server_tools.py", "test_peer_clients.py",
      "test_responses.py", "test_vllm_fields.py", "test_vllm_multi_turn.py", "test_lm_eval.py"),
     1250),
    (("test_server_fuzz.py",), 470),
    (("test_peer_aiperf.py",), 90),  # aiperf's venv installed from the registry, then a load
    (("test_disk_restore_leak.py",), 220),
    # both use conftest's fresh_chunk16
    (("test_remote_faults.py", "test_remote_tier.py"), 295),
    (("test_replicas.py",), 140),
    (("test_replicas_remote.py",), 120),
    (("test_server_faults.py",), 110),
    (("test_replicas_cluster.py",), 105),
    (("test_disk_server.py",), 90),
    (("test_long_prompt.py",), 115),
    (("test_server.py",), 90),
    (("test_replicas_probe.py",), 70),
    (("test_completions_echo.py",), 60),
    (("test_grammar.py",), 60),
    (("test_bench_serve.py",), 60),
)
"""The longest modules of the CPU run, with their seconds (sum of ``--durations``, a full run
on a loaded 2-core machine): they start first, on both workers."""


class _LongFirst:
    """A plugin of its own (registered by ``pytest_configure``): the conftest's own
    ``pytest_collection_modifyitems`` marks tests slow, before ``-m`` deselects them; this one
    runs last, on the items that will run."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        long_first(items)


def long_first(items: list[pytest.Item]) -> None:
    """Put the long modules first on both of xdist's workers. ``--dist worksteal`` hands the
    first half of the collection to one worker and the second to the other, each runs its
    share in order, and an idle worker steals from the end of the other's queue. In collection
    order the long server modules came last or late, one after another on one worker, so the
    run ended with one worker alone on them. Here the long modules are dealt to two halves,
    longest first to the half with fewer seconds, each half begins with its long modules, and
    the short tests (in collection order) fill the rest: what is stolen at the end is short.
    A module's tests stay together (its module-scoped servers start once)."""
    group_of = {m: g for g, (mods, _) in enumerate(LONG_GROUPS) for m in mods}
    long_items: list[list[pytest.Item]] = [[] for _ in LONG_GROUPS]
    short: list[pytest.Item] = []
    for item in items:
        g = group_of.get(item.path.name)
        (short if g is None else long_items[g]).append(item)
    halves: list[list[pytest.Item]] = [[], []]
    seconds = [0, 0]
    for g in sorted(range(len(LONG_GROUPS)), key=lambda g: -LONG_GROUPS[g][1]):
        if long_items[g]:
            h = seconds.index(min(seconds))
            halves[h] += long_items[g]
            seconds[h] += LONG_GROUPS[g][1]
    # the first half is len(items) // 2 items long (xdist's first share)
    fill = max(0, len(items) // 2 - len(halves[0]))
    items[:] = halves[0] + short[:fill] + halves[1] + short[fill:]


@pytest.fixture(scope="session")
def multiturn_module() -> Any:
    """``src/pensieve/bench/multiturn.py`` (a script) loaded as the module ``multiturn``."""

    return importlib.import_module("pensieve.bench.multiturn")
