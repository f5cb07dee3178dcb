"""The engine's command-line options, generated from the config dataclasses.

Every init field of :class:`~pensieve.config.ModelConfig`, :class:`~pensieve.config.CacheConfig`
and :class:`~pensieve.core.scheduling_config.SchedulerConfig` is one flag (vLLM's
``EngineArgs`` idea):
``chunk_size`` -> ``--chunk-size``, its type from the annotation, its help from the field's
docstring (read once from the source with :mod:`ast`), the dataclass's default shown in the
help. :data:`FLAG_SPECS` adds what an annotation cannot say: a parser for mixed types, the
choices (the cache policies come from :data:`pensieve.core.eviction.POLICIES`) and the older
aliases (``-tp``, ``--mixed-graphs``).

Every generated flag defaults to None, "not given", so that four layers resolve in
:func:`engine_options`: the dataclass default, under the command's own defaults (a benchmark's
setting, ``add_engine_args(defaults=...)``), under ``--config FILE`` (JSON, TOML, or YAML
when PyYAML is installed), under the flags given.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, fields
from functools import cache
from pathlib import Path
from typing import Any

from pensieve.config import DEFAULT_MODEL, KV_CACHE_DTYPES, CacheConfig, ModelConfig, owners
from pensieve.core.eviction import POLICIES
from pensieve.core.scheduling_config import (
    BATCHING_MODES,
    DEFAULT_MAX_MODEL_LEN,
    SchedulerConfig,
    budget_help,
    step_time_help,
)
from pensieve.help_text import plain_text

SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
"""Names of the parts in a ``--config`` file that groups its options (``cache: {...}``)."""

ENGINE_DEFAULTS = "engine_defaults"
"""The parsed arguments' attribute that holds the command's own defaults of engine options
(:func:`add_engine_args`)."""


def default_of(name: str) -> Any:
    """The config's default of option ``name`` (what a command that needs the value itself,
    such as the seed of its random prompts, takes when it was not set)."""
    return next(f.default for f in fields(owners()[name]) if f.name == name)


def float_or_nan(text: str) -> float:
    """``float(text)``, NaN for what is not a number (so a range check refuses it)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def swap_bandwidth_arg(text: str) -> float | str:
    """``--swap-bandwidth-gbps``: a positive number of GB/s, ``auto`` or ``off``."""
    t = text.strip().lower()
    if t in ("auto", "off"):
        return t
    if t == "none":
        return "off"
    v = float_or_nan(t)
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of GB/s, 'auto' or 'off', got {text!r}")
    return v


def fraction_arg(text: str) -> float:
    """A share in [0, 1) (``--decode-reserve``)."""
    v = float_or_nan(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return v


def steps_arg(text: str) -> int:
    """A whole number >= 0 (``--defer-admission``)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 0, got {text!r}")
    return int(text)


FLAG_SPECS: dict[str, dict[str, Any]] = {
    "tensor_parallel_size": {"aliases": ["-tp"]},
    "cuda_graph_mixed": {"aliases": ["--mixed-graphs"]},
    "swap_bandwidth_gbps": {"type": swap_bandwidth_arg, "metavar": "GBPS|auto|off"},
    "kv_cache_dtype": {"choices": list(KV_CACHE_DTYPES)},
    "cache_policy": {"choices": list(POLICIES)},
    "batching": {"choices": list(BATCHING_MODES)},
    "decode_reserve": {"type": fraction_arg, "metavar": "FRACTION"},
    "defer_admission": {"type": steps_arg, "metavar": "STEPS"},
    "prefill_attention_pairs": {"metavar": "PAIRS"},
    "max_num_batched_tokens": {"help": budget_help()},
    "step_time_target_s": {"help": step_time_help(), "metavar": "SECONDS"},
}
"""What a field's annotation does not say about its flag."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the first paragraph of its attribute docstring, on one line."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped: flags without their docstrings
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body.body, body.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            first = plain_text(inspect.cleandoc(nxt.value.value).split("\n\n")[0])
            docs[stmt.target.id] = " ".join(first.split())
    return docs


def _value_type(hint: Any) -> Any:
    """The type a flag parses to: ``int | None`` -> int; a bool stays bool."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return hint


def _flag_kwargs(cls: type, name: str, note: str | None = None, default: Any = MISSING
                 ) -> tuple[list[str], dict[str, Any]]:
    """(option strings, ``add_argument`` keywords) of one field's flag; ``note``: a help text
    of the command's own, default included; ``default``: the command's own default, shown in
    the help instead of the config's."""
    spec = dict(FLAG_SPECS.get(name, {}))
    flags = [f"--{name.replace('_', '-')}", *spec.pop("aliases", [])]
    own = default is not MISSING
    if not own:
        default = default_of(name)
    doc = spec.pop("help", None) or field_docs(cls).get(name, "")
    shown = "none" if default is None or default is MISSING else default
    if note:
        text = note
    elif "default" in doc:  # the config's default, told in words
        text = f"{doc} (this command's default: {shown})" if own else doc
    else:
        text = f"{doc} (default: {shown})"
    kw: dict[str, Any] = {"dest": name, "default": None, "help": text.replace("%", "%%")}
    vtype = _value_type(typing.get_type_hints(cls)[name])
    if vtype is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = spec.pop("type", vtype)
        if kw["type"] is None:
            raise TypeError(f"{cls.__name__}.{name} needs a parser in FLAG_SPECS")
    kw.update(spec)
    return flags, kw


def add_engine_args(p: argparse.ArgumentParser, exclude: Collection[str] = (),
                    help: Mapping[str, str] | None = None, model_flag: bool = False,
                    defaults: Mapping[str, Any] | None = None,
                    only: Collection[str] | None = None) -> None:
    """The engine's options (all but ``exclude``; ``only``: just those) and ``--config FILE``;
    ``help``: the command's own help of some options. The model is the positional argument,
    optional (``model_flag``: the option ``--model``, as the benchmarks take it). ``defaults``:
    the command's own defaults of some options (a benchmark's setting, such as the paper's tier
    sizes), shown in their help; :func:`engine_options` puts a ``--config`` file and the flags
    given over them."""
    notes = help or {}
    names = [n for n in owners() if n not in exclude and (only is None or n in only)]
    own = dict(defaults or {})
    unknown = sorted(set(own) - set(names))
    if unknown:
        raise ValueError(f"defaults of options this command does not take: {unknown}")
    p.set_defaults(**{ENGINE_DEFAULTS: own})
    if "model" in names:
        text = notes.get("model") or (field_docs(ModelConfig).get("model", "")
                                      + f" (default: {own.get('model', ModelConfig.model)})")
        if model_flag:
            p.add_argument("--model", default=None, help=text)
        else:
            p.add_argument("model", nargs="?", default=None, help=text)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a JSON, TOML or YAML file of engine options (the flags' names with "
                        "underscores, flat or under model/cache/scheduler); flags given on the "
                        "command line override it")
    group = p.add_argument_group("engine options (also keys of a --config file)")
    for name, cls in owners().items():
        if name in names and name != "model":
            flags, kw = _flag_kwargs(cls, name, notes.get(name), own.get(name, MISSING))
            group.add_argument(*flags, **kw)


def _convert(name: str, value: Any) -> Any:
    """A value from a config file, parsed and checked as its flag would be."""
    cls = owners()[name]
    _, kw = _flag_kwargs(cls, name)
    parse: Callable[[str], Any] | None = kw.get("type")
    if value is None:
        return None
    if "action" in kw:  # a bool
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(value, str) and parse is not None:
        try:
            value = parse(value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"{name}: {e}") from None
    elif isinstance(value, bool) or (parse is int and not isinstance(value, int)) or (
            parse is float and not isinstance(value, int | float)):
        raise ValueError(f"{name} must be a {getattr(parse, '__name__', 'value')}, "
                         f"got {value!r}")
    elif parse is float:
        value = float(value)
    elif parse is not None and parse not in (int, str):  # a checking parser: check as text
        value = _convert(name, str(value))
    if "choices" in kw and value not in kw["choices"]:
        raise ValueError(f"{name} must be one of {', '.join(kw['choices'])}, got {value!r}")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The engine options of a config file: ``.json``, ``.toml``, or ``.yaml``/``.yml``
    (needs PyYAML). Keys are field names (dashes allowed), flat or under ``model:``,
    ``cache:``, ``scheduler:``; unknown ones raise ValueError."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml", ".yaml", ".yml"):
        raise ValueError(f"{path}: a config file is .json, .toml, .yaml or .yml")
    text = path.read_text()
    if suffix == ".json":
        data = json.loads(text)
    elif suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{path}: reading TOML needs Python 3.11 (tomllib); "
                             "or write the file as JSON") from None
        data = tomllib.loads(text)
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                             "or write the file as JSON or TOML") from None
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    known = owners()
    opts: dict[str, Any] = {}
    for key, value in flat.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"{path}: unknown option {key!r}; known: {', '.join(known)}")
        opts[name] = _convert(name, value)
    return opts


def engine_options(args: argparse.Namespace, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The engine options that were set: the command's own defaults, the ``--config`` file's
    over them, then the flags given (None: not given) over those, for
    :func:`pensieve.engine.llm.build_engine_config`."""
    path = getattr(args, "config", None)
    opts = dict(getattr(args, ENGINE_DEFAULTS, None) or {})
    opts.update(load_config_file(path) if path else {})
    for name in owners():
        value = getattr(args, name, None)
        if name not in exclude and value is not None:
            opts[name] = value
    return {k: v for k, v in opts.items() if v is not None}


COMMAND_HELP = {
    "max_model_len": "longest context (default: the model's max_position_embeddings, "
                     f"{DEFAULT_MAX_MODEL_LEN} for a model that states none; more than that "
                     "is refused, and so is a length whose KV the GPU tier cannot hold for one "
                     "request)",
}
"""Help of the options whose default ``serve`` and ``generate`` settle from the model
(:func:`settle_model_options`), not from the config."""


def checked_max_model_len(requested: int | None, hf_config: Any,
                          default: int = DEFAULT_MAX_MODEL_LEN) -> int:
    """``--max-model-len``: refused beyond the model's ``max_position_embeddings``; without
    it, the model's own limit (``default`` for a config that states none). Whether one request
    of that length fits the GPU tier is checked once the tiers are sized
    (:func:`pensieve.engine.tiers.check_fits`)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is not None:
        if requested < 1:
            raise SystemExit(f"--max-model-len must be >= 1, got {requested}")
        if limit is not None and requested > int(limit):
            raise SystemExit(f"--max-model-len {requested} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return requested
    return int(limit) if limit is not None else default


def settle_model_options(opts: dict[str, Any]) -> tuple[Any, str | None]:
    """The defaults of ``serve`` and ``generate`` that depend on the model, set in ``opts``:
    the model (:data:`~pensieve.config.DEFAULT_MODEL`) and ``max_model_len`` (the model's
    own limit, :func:`checked_max_model_len`). Returns the model's HF config and its
    checkpoint directory (None for a preset shape)."""
    from pensieve.models.loader import resolve_config

    hf_config, path = resolve_config(opts.setdefault("model", DEFAULT_MODEL))
    opts["max_model_len"] = checked_max_model_len(opts.get("max_model_len"), hf_config)
    return hf_config, None if path is None else str(path)
