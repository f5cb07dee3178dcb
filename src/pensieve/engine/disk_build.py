"""Building the tiers below the CPU tier from the config: the local disk tier
(``--disk-kv-gb``, ``--disk-kv-path``) and the shared store (``--kv-remote``), one
:class:`~pensieve.engine.disk_tier.DiskTier` over both; and the model digest their files'
fingerprint carries."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

import torch

from pensieve.config import CacheConfig
from pensieve.core.disk_index import require_cpu_tier
from pensieve.engine import disk_files
from pensieve.engine.disk_tier import DiskTier
from pensieve.engine.remote_tier import RemoteTier, open_remote

log = logging.getLogger("pensieve")

REMOTE_INDEX_CHUNKS = 1 << 18
"""Entries of the index when the shared store is the only tier below the CPU tier (no
--disk-kv-path): chunks this server spilled there or found there that it keeps track of."""


def build_disk_tier(cc: CacheConfig, model_name: str, executor: Any, model: Any,
                    model_dtype: torch.dtype) -> DiskTier | None:
    """The tiers below the CPU tier of ``cc`` for the model ``model_name`` over a local
    executor's tiers (None: none asked for, or none usable: a local path that cannot be
    written and a remote store that cannot be reached are logged warnings, the server runs
    without them). Raises ValueError when the engine is tensor parallel, or has no CPU tier.
    The read rate is measured on CUDA only: on the CPU the cost model's recompute times are a
    GPU's (as for ``swap_bandwidth_gbps``, whose ``auto`` is off there), so without
    ``disk_read_gbps`` chunks on disk are always read back."""
    local = bool(cc.disk_kv_gb and cc.disk_kv_path)
    if not local and not cc.kv_remote:
        return None
    runner = getattr(executor, "runner", None)
    if runner is None:
        raise ValueError("the disk tier and --kv-remote need a local executor (not tensor "
                         "parallel)")
    require_cpu_tier(executor.tiers.num_cpu_blocks)
    if local:
        assert cc.disk_kv_path is not None
        try:
            disk_files.check_writable(cc.disk_kv_path)
        except ValueError as e:  # a full or read-only disk: serve without the tier
            log.warning("disk tier off: %s", e)
            local = False
    layout = runner.layout  # one device: the model's KV heads, all of them
    fp = disk_files.fingerprint(model_name, str(model_dtype), str(layout.dtype),
                                layout.chunk_size, layout.num_layers, layout.num_kv_heads,
                                layout.head_dim, model_digest(model, model_name))
    block_bytes = layout.block_bytes
    cuda = runner.kv_caches[0].device.type == "cuda"
    remote = None
    if cc.kv_remote:
        backend = open_remote(cc.kv_remote, fp)
        if backend is not None:
            remote = RemoteTier(backend, fp, layout.chunk_size, block_bytes, pin=cuda)
            log.info("remote KV tier: %s", backend.url)
    if not local and remote is None:
        return None
    capacity = int(cc.disk_kv_gb * 2**30 // block_bytes) if local and cc.disk_kv_gb \
        else REMOTE_INDEX_CHUNKS
    tier = DiskTier(cc.disk_kv_path if local else None, capacity, layout, fp,
                    runner.swapper.cpu_caches, runner.kv_caches,
                    read_gbps=cc.disk_read_gbps, measure=cuda, remote=remote)
    if local:
        assert cc.disk_kv_path is not None
        log.info("disk tier: %d chunks (%.2f GiB) in %s", capacity,
                 capacity * block_bytes / 2**30, cc.disk_kv_path)
        room = shutil.disk_usage(cc.disk_kv_path).free + tier.index.size * block_bytes
        if room < capacity * block_bytes:
            log.warning("disk tier: %s has room for %.2f GiB of the %.2f GiB asked; writes "
                        "that fail once it is full drop their chunks", cc.disk_kv_path,
                        room / 2**30, capacity * block_bytes / 2**30)
    return tier


DIGEST_SLICE = 1 << 24
"""Elements summed at once by :func:`model_digest` (bounds its temporary memory)."""


def model_digest(model: torch.nn.Module, model_path: str) -> str:
    """A digest of the model's weights and config, for the disk tier's fingerprint: the
    ``config.json`` beside the weights (rotary and norm settings change the KV too) and, per
    tensor of the state dict, its name, shape, dtype, the exact integer sum of its elements'
    bits and 64 evenly spaced elements. Weights changed in place under the same path change it
    (any changed element changes the sum unless other changes cancel it exactly); integer sums
    make it the same whatever the device's reduction order. One read of the weights."""
    h = hashlib.blake2b(digest_size=12)
    cfg = os.path.join(model_path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            flat = t.detach().contiguous().reshape(-1)
            if flat.numel() == 0 or flat.element_size() not in bits:
                continue
            ints = flat.view(bits[flat.element_size()])
            total = sum(int(ints[i:i + DIGEST_SLICE].sum(dtype=torch.int64))
                        for i in range(0, ints.numel(), DIGEST_SLICE))
            # evenly spaced, in integers (a float32 linspace rounds 28,311,551 up to
            # 28,311,552: past the end of SmolLM2's embedding)
            k = min(64, ints.numel())
            at = torch.arange(k, device=ints.device) * (ints.numel() - 1) // max(k - 1, 1)
            h.update(f"{total};".encode() + ints[at].cpu().numpy().tobytes())
    return h.hexdigest()
