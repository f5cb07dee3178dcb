"""Size flags: a file of the source roots over 600 lines, a function over 80 lines
(``@triton.jit`` functions are exempt), and the recorded results (``--results DIR``) over
2 MiB in all, so that the tree holds the small outputs the docs cite and git history the rest.
Prints each offender and exits 1 if there is one.

The file limit is a flag, not a place to cut: a file's length should follow its idea. Under it,
one concern stays in one module (split a file by concern, never at a line count: a module that
exists only to keep its owner under the limit, taking the owner's object, is the wrong cut).

    python scripts/size_check.py [ROOT ...] [--results DIR]   # default: src
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_RESULTS_BYTES = 2 * 1024 * 1024
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


def results_offenders(root: Path) -> list[str]:
    """One line if the files under ``root`` hold more than ``MAX_RESULTS_BYTES`` together,
    naming the largest ones."""
    sizes = sorted(((p.stat().st_size, p) for p in root.rglob("*") if p.is_file()), reverse=True)
    total = sum(s for s, _ in sizes)
    if total <= MAX_RESULTS_BYTES:
        return []
    largest = ", ".join(f"{p} ({s} B)" for s, p in sizes[:5])
    return [f"{root}: {total} bytes (limit {MAX_RESULTS_BYTES}); largest: {largest}"]


def main(argv: list[str]) -> int:
    results = []
    while "--results" in argv:
        i = argv.index("--results")
        results.append(Path(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    roots = [Path(a) for a in argv] or [Path("src")]
    found = [o for root in roots for p in sorted(root.rglob("*.py")) for o in offenders(p)]
    found += [o for root in results for o in results_offenders(root)]
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
