"""Size limits on src/: no file over 500 lines, no function over 80 lines (``@triton.jit``
functions are exempt). Prints each offender and exits 1 if there is one.

    python scripts/size_check.py [ROOT ...]   # default: src
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
PENDING: dict[str, str] = {}
"""Known offenders, printed but not failing the check: ``"path"`` or ``"path:function"`` -> why it
waits. Remove an entry once it is fixed (an entry that no longer offends fails the check, so the
list cannot go stale)."""


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr in ("jit", "autotune", "heuristics"):
            if isinstance(target.value, ast.Name) and target.value.id == "triton":
                return True
    return False


def offenders(path: Path) -> list[str]:
    """One line per limit ``path`` breaks."""
    text = path.read_text()
    out = []
    n = len(text.splitlines())
    if n > MAX_FILE_LINES:
        out.append(f"{path}: {n} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        fn = (ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, fn) and not _is_triton_kernel(node):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno}: {node.name}() {length} lines "
                           f"(limit {MAX_FUNCTION_LINES})")
    return out


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("src")]
    found = [o for root in roots for p in sorted(root.rglob("*.py")) for o in offenders(p)]
    pending, failing = [], []
    for o in found:
        key = next((k for k in PENDING if o.startswith(k.split(":")[0] + ":")
                    and (":" not in k or f" {k.split(':')[1]}()" in o)), None)
        (pending if key else failing).append((key, o))
    stale = set(PENDING) - {k for k, _ in pending}
    for _, o in pending:
        print(f"pending: {o}")
    for _, o in failing:
        print(o)
    for k in sorted(stale):
        print(f"{k}: listed in PENDING but within the limits now: remove it from the list")
    if not failing and not stale:
        print("size check: ok" + (f" ({len(pending)} pending)" if pending else ""))
    return 1 if failing or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
