"""Build a model from an HF config and fill its weights (checkpoint or dummy).

``load_model(path_or_config, dtype, device)`` reads ``config.json`` locally, builds the model on
the ``meta`` device, materialises it directly on ``device`` in ``dtype`` (no CPU copy, no random
init), then streams safetensors (``model.safetensors`` or the sharded index) tensor by tensor
onto the device. A ``.gguf`` file is read the same way through :mod:`pensieve.models.gguf`
(config from its metadata, tensors dequantized and renamed as they stream). Built-in names
(:mod:`pensieve.models.builtin`: the default SmolLM2, ``demo-random``) resolve to their cached
checkpoint directories. ``load_format="dummy"`` reads no checkpoint and fills the weights
randomly on the device; it works from a config alone (a preset name, a dict or a
``PretrainedConfig``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pensieve.layers.attention import number_attention_layers
from pensieve.models import get_model_class
from pensieve.models.builtin import resolve_builtin
from pensieve.models.gguf import gguf_config, is_gguf, iter_gguf_tensors
from pensieve.models.presets import PRESETS, make_dummy_config

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
DUMMY_RANGE = 1e-3
"""Dummy weights are uniform(-DUMMY_RANGE, DUMMY_RANGE); norm weights 1, norm biases 0."""


def resolve_config(model: str | os.PathLike | dict | PretrainedConfig) -> tuple[Any, str | None]:
    """``(hf_config, checkpoint path or None)`` from a directory, a ``.gguf`` file, a built-in
    name, a preset name, a dict or a config."""
    if isinstance(model, PretrainedConfig):
        return model, None
    if isinstance(model, dict):
        d = dict(model)
        if "model_type" not in d:
            raise ValueError("a dict config needs a 'model_type' key (e.g. 'llama', 'opt')")
        return AutoConfig.for_model(d.pop("model_type"), **d), None
    path = os.fspath(model)
    path = resolve_builtin(path) or path
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True), path
    if is_gguf(path):
        return gguf_config(path), path
    if path in PRESETS:
        return make_dummy_config(path), None
    raise FileNotFoundError(f"{path!r} is neither a model directory, a .gguf file, a built-in "
                            f"model nor a preset {sorted(PRESETS)}")


@contextlib.contextmanager
def _no_normal_init_on_meta() -> Iterator[None]:
    """``nn.init.normal_`` skips meta tensors meanwhile. ``nn.Embedding`` initialises its weight
    with it, and on a meta tensor that runs torch's Python reference, whose first call imports
    ``torch._dynamo`` (~1 s in each engine process); the weights are filled from the
    checkpoint (or dummy values) once materialised, so nothing is lost."""
    normal = nn.init.normal_

    def normal_unless_meta(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if tensor.is_meta else normal(tensor, *args, **kwargs)

    nn.init.normal_ = normal_unless_meta  # type: ignore[assignment]
    try:
        yield
    finally:
        nn.init.normal_ = normal


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Construct the model class for ``hf_config`` with uninitialised parameters on ``device``."""
    cls = get_model_class(hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _no_normal_init_on_meta():
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    number_attention_layers(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def load_model(
    model_dir: str | os.PathLike | dict | PretrainedConfig,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cuda",
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[nn.Module, Any]:
    """Returns ``(model, hf_config)``; the model is in eval mode with ``requires_grad`` off.

    ``load_format``: ``auto`` (safetensors, else ``pytorch_model*.bin``), ``safetensors``,
    ``pt``, or ``dummy`` (random weights; ``model_dir`` may then be a preset name such as
    ``"llama2-13b-gqa10"``, a dict with ``model_type``, or an HF config object).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} not in {LOAD_FORMATS}")
    device = _normalize_device(device)
    hf_config, path = resolve_config(model_dir)
    model = build_model(hf_config, dtype, device)
    model.requires_grad_(False)
    model.eval()
    if load_format == "dummy":
        fill_dummy_weights(model, seed=seed)
        return model, hf_config
    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a model directory, got {model_dir!r}")
    scales: dict[int, dict[str, torch.Tensor]] = {}
    filled = model.load_weights(split_kv_scales(iter_checkpoint(path, device, load_format),
                                                scales))
    model.checkpoint_kv_scales = kv_scales_of(scales, getattr(model, "num_kv_heads", 0))
    missing = sorted(set(dict(model.named_parameters())) - set(filled))
    if missing:
        shown = ", ".join(missing[:20])
        if len(missing) > 20:
            shown += f", ... ({len(missing)} in all)"
        raise ValueError(f"checkpoint {path} did not fill these parameters: {shown}")
    return model, hf_config


_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
"""A calibrated FP8 KV-cache scale as vLLM / llm-compressor checkpoints name it
(``model.layers.3.self_attn.k_scale``; a scalar, or one per KV head)."""


def split_kv_scales(weights: Iterable[tuple[str, torch.Tensor]],
                    scales: dict[int, dict[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the KV-cache scales, which are put in ``scales[layer]["k" | "v"]``
    as they stream past (they are not parameters of the model)."""
    for name, tensor in weights:
        m = _KV_SCALE.search(name)
        if m is None:
            yield name, tensor
        else:
            scales.setdefault(int(m.group(1)), {})[m.group(2)] = tensor.detach().float().cpu()


def kv_scales_of(scales: dict[int, dict[str, torch.Tensor]], num_kv_heads: int
                 ) -> dict[int, torch.Tensor] | None:
    """Per layer ``[2, num_kv_heads]`` (K, V) from a checkpoint's scales (a scalar is every
    head's; a missing K or V scale is 1), for :func:`~pensieve.layers.attention.
    init_kv_scales`; None if the checkpoint has none. An FP8 KV cache uses them; others
    ignore them."""
    if not scales:
        return None
    out = {}
    for layer, kv in scales.items():
        rows = []
        for key in ("k", "v"):
            t = kv.get(key, torch.ones(()))
            if t.numel() not in (1, num_kv_heads):
                raise ValueError(f"layer {layer}: {key}_scale has {t.numel()} values, expected "
                                 f"1 or {num_kv_heads} (one per KV head)")
            if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                raise ValueError(f"layer {layer}: {key}_scale must be finite and > 0, got "
                                 f"{t.flatten().tolist()}")
            rows.append(t.reshape(-1).expand(num_kv_heads))
        out[layer] = torch.stack(rows)
    return out


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, scale: float = DUMMY_RANGE) -> None:
    """Random weights on the model's device; activations stay small and finite in bf16/fp16."""
    params = list(model.parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0].device)
    gen.manual_seed(seed)
    for p in params:
        p.uniform_(-scale, scale, generator=gen)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm"):
            if getattr(m, "weight", None) is not None:
                m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


def checkpoint_files(model_dir: str, load_format: str = "auto") -> tuple[str, list[str]]:
    """``("safetensors" | "pt" | "gguf", files)`` of the checkpoint in ``model_dir`` (or of the
    ``.gguf`` file ``model_dir``)."""
    if is_gguf(model_dir):
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"{model_dir} is a GGUF file, not load_format={load_format!r}")
        return "gguf", [model_dir]
    candidates = {
        "safetensors": ("model.safetensors", "model.safetensors.index.json"),
        "pt": ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    }
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {model_dir}")
    kinds = ["safetensors", "pt"] if load_format == "auto" else [load_format]
    for kind in kinds:
        single, index = candidates[kind]
        if os.path.isfile(os.path.join(model_dir, single)):
            return kind, [os.path.join(model_dir, single)]
        if os.path.isfile(os.path.join(model_dir, index)):
            with open(os.path.join(model_dir, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return kind, [os.path.join(model_dir, s) for s in shards]
    raise FileNotFoundError(f"no {'/'.join(kinds)} checkpoint in {model_dir}")


def iter_checkpoint(
    model_dir: str, device: torch.device, load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one at a time (safetensors: read straight onto ``device``)."""
    kind, files = checkpoint_files(model_dir, load_format)
    if kind == "gguf":
        for name, tensor in iter_gguf_tensors(files[0]):
            yield name, tensor.to(device) if device.type != "meta" else tensor
    elif kind == "safetensors":
        from safetensors import safe_open

        st_device = "cpu" if device.type == "meta" else str(device)
        for file in files:
            with safe_open(file, framework="pt", device=st_device) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    else:
        for file in files:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
