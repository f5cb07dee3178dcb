"""No module of the pure-Python core changes another module's object state, as
``test_architecture.py`` checks imports: the state of an owner (a class of ``pensieve.core``
that is not a plain record: the cache, its store, the block map, the disk index, the
eviction index, the block pools, the scheduler) is written only by the module that defines
its class, through its methods elsewhere. Records (dataclasses, named tuples, enums: a
conversation, a chunk, a request, a plan, counters) are data that their holders fill in.

Static, from the source: a write is an assignment, augmented assignment or ``del`` whose
target, or a call of a mutating method (``append``, ``pop``, ``setdefault``, ...) whose
receiver, goes through an attribute that an owner class of another module sets on ``self``
(``share.refs[b] = n``, ``disk.salts[cid] = salt``, ``pools.plan.swap_in.append(p)``).
Reading another owner's public attributes is allowed; a private one (``x._name``) of any
object but ``self`` is not read either.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "src" / "pensieve" / "core"
MUTATING = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard", "appendleft", "popleft", "sort", "reverse"}
RECORD_BASES = {"NamedTuple", "Enum", "Protocol", "TypedDict", "Exception", "ValueError",
                "RuntimeError", "IntEnum"}


def _is_record(cls: ast.ClassDef) -> bool:
    if any(isinstance(d, ast.Name | ast.Call | ast.Attribute) and "dataclass" in ast.unparse(d)
           for d in cls.decorator_list):
        return True
    return any(ast.unparse(b).split(".")[-1] in RECORD_BASES for b in cls.bases)


def owned_attributes() -> dict[str, set[str]]:
    """Module name -> attributes its owner classes set on ``self`` (or define as
    properties)."""
    out: dict[str, set[str]] = {}
    for f in CORE.glob("*.py"):
        attrs: set[str] = set()
        for cls in ast.walk(ast.parse(f.read_text())):
            if not isinstance(cls, ast.ClassDef) or _is_record(cls):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    attrs.add(node.attr)
                elif isinstance(node, ast.FunctionDef) and any(
                        ast.unparse(d) == "property" for d in node.decorator_list):
                    attrs.add(node.name)
        out[f.stem] = attrs
    return out


def _chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """The base of ``node`` (through subscripts and attributes) and the attribute names
    on the way, outermost last."""
    names: list[str] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return node, names[::-1]


def record_fields() -> set[str]:
    """The fields of the core's records (a conversation's ``running`` is its own data)."""
    out: set[str] = set()
    for f in CORE.glob("*.py"):
        for cls in ast.walk(ast.parse(f.read_text())):
            if isinstance(cls, ast.ClassDef) and _is_record(cls):
                out.update(n.target.id for n in cls.body
                           if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    return out


def _aliases(fn: ast.AST, foreign: set[str]) -> dict[str, str]:
    """Local names bound to a foreign owner's attribute (``refs = share.refs``, also in
    tuple assignments): writing through them writes the owner's state."""
    out: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for t in node.targets:
            pairs = (zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(t, node.value)])
            for name, value in pairs:
                if isinstance(name, ast.Name) and isinstance(value, ast.Attribute):
                    base, names = _chain(value)
                    if isinstance(base, ast.Name) and base.id == "self":
                        names = names[1:]
                    bad = [n for n in names if n in foreign]
                    if bad:
                        out[name.id] = bad[0]
    return out


def violations() -> list[str]:
    owned = owned_attributes()
    records = record_fields()
    out: list[str] = []
    for f in sorted(CORE.glob("*.py")):
        foreign = (set().union(*(a for m, a in owned.items() if m != f.stem))
                   - owned[f.stem] - records)
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                aliases = _aliases(fn, foreign)
                for node in ast.walk(fn):
                    target: ast.expr | None = None
                    if isinstance(node, ast.Subscript) and isinstance(node.ctx,
                                                                      ast.Store | ast.Del):
                        target = node.value
                    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                            and node.func.attr in MUTATING:
                        target = node.func.value
                    if isinstance(target, ast.Name) and target.id in aliases:
                        out.append(f"{f.name}:{node.lineno}: {ast.unparse(node)} (through "
                                   f"{target.id} = ...{aliases[target.id]})")
        for node in ast.walk(tree):
            written: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                written = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                written = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATING:
                written = [node.func.value]
            for t in written:
                for one in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    base, names = _chain(one)
                    if isinstance(base, ast.Name) and base.id == "self":
                        names = names[1:]  # self's own attribute, then what it holds
                    if not isinstance(one, ast.Attribute | ast.Subscript):
                        continue
                    bad = [n for n in names if n in foreign]
                    if bad and not (isinstance(base, ast.Name) and base.id == "self"
                                    and len(names) == 0):
                        out.append(f"{f.name}:{node.lineno}: {ast.unparse(one)} ({bad[0]})")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{f.name}:{node.lineno}: reads {ast.unparse(node)}")
    return sorted(set(out))


def test_the_checker_finds_a_foreign_write(tmp_path: Path) -> None:
    base, names = _chain(ast.parse("pools.share.refs[b]").body[0].value)  # type: ignore[attr-defined]
    assert isinstance(base, ast.Name) and base.id == "pools" and names == ["share", "refs"]
    owned = owned_attributes()
    assert {"by_hash", "hash_of"} <= owned["block_map"] and "salts" in owned["disk_index"]
    assert "conversations" in owned["tiered_cache"]
    assert "chunks" not in set().union(*owned.values())  # Conversation is a record


def test_no_core_module_writes_another_modules_owner_state() -> None:
    assert violations() == []
