"""Rules on how the modules under ``src/pensieve`` depend on each other, checked on their syntax
trees (nothing is imported): no import cycle, and the engine config
(:class:`pensieve.config.EngineConfig` and its parts in :mod:`pensieve.config`) read only by the
engine, the executors and the sizing module."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from pensieve.config import EngineConfig

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``pensieve`` package."""
    out = {}
    for path in sorted((SRC / "pensieve").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ``pensieve`` modules an import statement in module ``name`` loads (an imported name
    that is a submodule counts as that submodule, any other as its module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    if node.level:
        base = name.split(".")
        if MODULES[name].name != "__init__.py":
            base.pop()
        base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = set()
    for a in node.names:
        if f"{module}.{a.name}" in MODULES:
            out.add(f"{module}.{a.name}")
        elif module in MODULES:
            out.add(module)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports anywhere (top level, inside functions, under
    ``TYPE_CHECKING``): a deferred import still ties the two modules together."""
    graph = {}
    for name, tree in TREES.items():
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                deps |= _imported(name, node)
        deps.discard(name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_under_src() -> None:
    graph = _import_graph()
    assert graph["pensieve.engine.llm_engine"] >= {"pensieve.config", "pensieve.engine.engine_core"}
    assert _cycles(graph) == []


ENGINE_CONFIG_READERS = {
    "pensieve.config": "defines it",
    "pensieve.core.tiered_cache": "the cache (and its store) is built from CacheConfig whole: "
                                  "each option's one default is there",
    "pensieve.engine.llm_engine": "the engine: LLMEngine is assembled from it",
    "pensieve.engine.llm": "the engine's front end: LLM builds it from flat keyword options "
                           "(build_engine_config) and hands it to LLMEngine",
    "pensieve.engine.local": "the local executor and the load / size / allocate / capture "
                             "steps the tensor-parallel ranks share",
    "pensieve.engine.tiers": "the sizing module: config, block bytes and free memory -> tiers",
    "pensieve.engine.kv_layout": "the KV layout: chunk size and KV dtype from CacheConfig, "
                                 "resolved once with the model's shape",
    "pensieve.engine.disk_build": "the tiers below the CPU tier, sized and placed by the "
                                  "cache config (disk_kv_gb, disk_kv_path, disk_read_gbps, "
                                  "kv_remote)",
    "pensieve.parallel.tp_executor": "an executor: TPExecutor",
    "pensieve.parallel.worker": "an executor: the tensor-parallel ranks behind TPExecutor",
    "pensieve.sim.simulator": "an executor: SimEngine.from_config sizes the simulated tiers "
                                "as the engine would (through engine.tiers) for SimExecutor",
    "pensieve.options": "the command lines' engine options, generated from the config "
                        "dataclasses' fields (names, types, docstrings, defaults)",
}
"""The modules that may read the engine config, and why."""

ENGINE_CONFIG_BUILDERS = {
    "pensieve.server.main": "the server's composition root: builds it from the command line "
                            "(build_engine_config) and passes it to LLMEngine, reading nothing",
    "pensieve.bench.multiturn": "the in-process benchmark's composition root: builds the "
                                "engine of its real points from its command line",
}
"""Modules that may build an engine config and pass it on, but read none of it."""

_CONFIG_NAMES = {"EngineConfig", "ModelConfig", "CacheConfig"}
_CONFIG_MEMBERS = {f.name for f in dataclasses.fields(EngineConfig)} | {
    n for n in vars(EngineConfig) if not n.startswith("_") and callable(vars(EngineConfig)[n])}


def _engine_like(node: ast.expr) -> bool:
    """``eng``, ``engine``, ``self.engine``, ``llm.engine``, ``self._engine``..."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name.lstrip("_") in ("eng", "engine", "llm_engine")


def _config_reads(name: str, tree: ast.AST) -> list[str]:
    """Where module ``name`` reaches the engine config: by importing one of the config types of
    :mod:`pensieve.config` (or the whole module), naming one, building one with
    ``build_engine_config`` (allowed in a builder, as long as nothing of the result is read),
    taking ``<engine>.config``, or reading ``<...>.config.<field>``. The syntax tree has no
    types: these are the ways in."""
    found = []
    built: set[str] = set()
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import | ast.ImportFrom) and "pensieve.config" in _imported(
                name, node):
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            for n in sorted(names & (_CONFIG_NAMES | {"*"})) if names else ["pensieve.config"]:
                found.append(f"{where}: imports {n}")
        elif isinstance(node, ast.Name) and node.id in _CONFIG_NAMES:
            found.append(f"{where}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in _CONFIG_NAMES:
            found.append(f"{where}: names {node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "config" \
                and _engine_like(node.value):
            found.append(f"{where}: takes an engine's config")
        elif isinstance(node, ast.Attribute) and node.attr in _CONFIG_MEMBERS \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "config":
            found.append(f"{where}: reads .config.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                node.func, "attr", None)) == "build_engine_config":
            if name not in ENGINE_CONFIG_BUILDERS:
                found.append(f"{where}: builds an engine config")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(
                node.value.func, "id", None) == "build_engine_config":
            built |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute | ast.Subscript) and isinstance(
                node.value, ast.Name) and node.value.id in built:
            found.append(f"{name}:{node.lineno}: reads the engine config it built")
    return found


def test_config_reads_are_found() -> None:
    """The checker sees each way in (so an empty result below means something)."""
    src = ("from pensieve.config import CacheConfig\n"
           "from pensieve.engine.llm import build_engine_config\n"
           "def f(eng, x):\n"
           "    a = eng.config\n"
           "    b = x.config.scheduler.max_num_seqs\n"
           "    cfg = build_engine_config(model='m')\n"
           "    return cfg.cache.chunk_size\n")
    def kinds(module: str, text: str) -> list[str]:
        return sorted(f.split(": ", 1)[1] for f in _config_reads(module, ast.parse(text)))

    assert kinds("pensieve.server.main", src) == [
        "imports CacheConfig", "reads .config.scheduler", "reads the engine config it built",
        "takes an engine's config"]
    assert "builds an engine config" in kinds("pensieve.cli", src)  # not a builder
    assert kinds("pensieve.cli", "def g(c):\n    return c.config.decode_graph_shape('cuda')\n"
                 ) == ["reads .config.decode_graph_shape"]
    assert kinds("pensieve.cli", "def h(model):\n    return model.config.hidden_size\n") == []
    assert kinds("pensieve.cli", "from pensieve.config import swap_chunk_seconds\n") == []
    assert kinds("pensieve.cli", "import pensieve.config\nx = pensieve.config.EngineConfig\n"
                 ) == ["imports pensieve.config", "names EngineConfig"]


def test_engine_config_read_only_by_the_engine_executors_and_sizing() -> None:
    assert set(ENGINE_CONFIG_READERS) | set(ENGINE_CONFIG_BUILDERS) <= set(MODULES)
    found = [f for name, tree in TREES.items() if name not in ENGINE_CONFIG_READERS
             for f in _config_reads(name, tree)]
    assert found == [], "\n".join(found)
    # the allow-list is not stale: each listed reader does reach it (the ranks get it untyped,
    # as WorkerSpec.config, which the syntax tree cannot tell from any other field)
    for name in set(ENGINE_CONFIG_READERS) - {"pensieve.parallel.worker"}:
        assert _config_reads(name, TREES[name]), f"{name} no longer reads the engine config"
