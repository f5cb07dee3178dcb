"""Count the Triton kernel variants a piece of code makes Triton compile, on any device.

A server's start is mostly compiling kernels (docs/long_context.md, "Server start"): Triton
compiles one binary per distinct *variant* of a ``@triton.jit`` kernel it launches, a variant
being the kernel, its constexpr values, the launch options (``num_warps``, ``num_stages``) and
the specialization of every other argument (its dtype, a pointer's 16-byte alignment, an
integer's ``== 1`` and divisibility by 16 unless the kernel's ``do_not_specialize`` names it).

:func:`recording` replaces the kernels of this package's ``triton_*`` modules, for the
duration of a ``with`` block, by wrappers that note each launch's variant key (built as
``triton.runtime.jit`` builds its cache key, with the base backend's specialization) and then
launch (``launch=True``) or skip the launch (a dry run: only the counting). It works under the
interpreter (``TRITON_INTERPRET=1``) as on a GPU, so a CPU test can count what a warm-up would
compile on the GPU (the launchers' tile choices come from their arguments, not the device).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

MODULES = ("triton_attention", "triton_dequant", "triton_fused", "triton_swap")
"""The modules (under ``pensieve.kernels``) whose ``@triton.jit`` kernels are counted."""


@dataclass
class VariantLog:
    """The variants launched inside one :func:`recording` block."""

    keys: set[tuple[Any, ...]] = field(default_factory=set)
    """One key per distinct variant: ``(kernel name, specialization, options)``."""
    launches: int = 0

    def count(self, kernel: str | None = None) -> int:
        """Distinct variants (of ``kernel`` only, if given)."""
        return sum(1 for k in self.keys if kernel is None or k[0] == kernel)

    def by_kernel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.keys:
            out[k[0]] = out.get(k[0], 0) + 1
        return dict(sorted(out.items()))


def _params(kernel: Any) -> list[tuple[str, bool, bool]]:
    """``(name, is_constexpr, specialize)`` of each parameter of a jitted kernel."""
    fn = kernel.fn
    kw = getattr(kernel, "kwargs", None) or {}
    skip = set(kw.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or ())
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__",
                                                                           str(p.annotation))
        out.append((name, "constexpr" in str(ann), name not in skip))
    return out


def variant_key(kernel: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[Any, ...]:
    """The key Triton's cache would file this launch under (with the base backend)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = _params(kernel)
    bound = dict(zip((p[0] for p in params), args))
    options = {k: v for k, v in kwargs.items() if k not in bound and
               k not in {p[0] for p in params}}
    bound.update({k: v for k, v in kwargs.items() if k not in options})
    spec = []
    for pname, is_const, specialize in params:
        v = bound.get(pname)
        if is_const:
            spec.append(("constexpr", v))
        elif isinstance(v, float):
            spec.append(("fp32", None))
        else:
            spec.append(tuple(native_specialize_impl(BaseBackend, v, False, specialize, True)))
    return (name, tuple(spec), tuple(sorted((k, repr(v)) for k, v in options.items())))


class _Recorder:
    """Stands in for one jitted kernel: ``kernel[grid](...)`` notes the variant, then
    launches it unless dry."""

    def __init__(self, kernel: Any, name: str, log: VariantLog, launch: bool) -> None:
        self.kernel, self.name, self.log, self.launch = kernel, name, log, launch

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.log.keys.add(variant_key(self.kernel, self.name, args, kwargs))
            self.log.launches += 1
            return self.kernel[grid](*args, **kwargs) if self.launch else None
        return run

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.kernel, attr)


@contextmanager
def recording(launch: bool = True) -> Iterator[VariantLog]:
    """Count the variants launched inside the block (module docstring); ``launch=False``
    skips the launches themselves (the outputs are then not computed)."""
    import importlib

    log = VariantLog()
    patched: list[tuple[Any, str, Any]] = []
    try:
        for m in MODULES:
            mod = importlib.import_module(f"pensieve.kernels.{m}")
            for attr, obj in list(vars(mod).items()):
                if attr.endswith("_kernel") and hasattr(obj, "fn"):
                    patched.append((mod, attr, obj))
                    setattr(mod, attr, _Recorder(obj, attr, log, launch))
        yield log
    finally:
        for mod, attr, obj in patched:
            setattr(mod, attr, obj)


__all__ = ["MODULES", "VariantLog", "recording", "variant_key"]
