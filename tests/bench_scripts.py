"""Load a script of ``benchmarks/`` as a module under its own name, so that its
``from decode_step import ...`` finds a sibling (``benchmarks/`` is put on ``sys.path``, as
running the script puts its folder there)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (loaded once)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
