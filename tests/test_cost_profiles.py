"""Which cost profile the engine takes (``engine/costs.py``): its own device's, else on a GPU
the same model shape measured on another GPU, else the analytic model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pensieve.core.cost_model import CostModel
from pensieve.engine.costs import PACKAGE_PROFILES, find_profile, load_cost_model
from pensieve.models.presets import PRESETS
from pensieve.runner.profiler import analytic_cost_model, config_profile_key

SHAPE = "llama-L32-H4096-q32-kv8-d128-i14336"  # llama3.1-8b's, shipped for the H200


def test_the_shipped_h200_profile_stands_in_for_another_gpu(
        caplog: pytest.LogCaptureFixture) -> None:
    """An H100 has no llama3.1-8b profile of its own: the H200's is taken, with a warning, and
    its recompute cost per chunk is the measured one, 4-5x the analytic roofline's (with which
    a chunk's disk read was never worth starting)."""
    key = f"{SHAPE}__NVIDIA_H100_80GB_HBM3"
    assert not (PACKAGE_PROFILES / f"{key}.json").exists()
    with caplog.at_level(logging.WARNING, logger="pensieve"):
        p = find_profile(key, gpu=True)
    assert p == PACKAGE_PROFILES / f"{SHAPE}__NVIDIA_H200.json"
    assert "another GPU" in caplog.text and key in caplog.text
    measured = CostModel.load(p).chunk_cost(1024)
    analytic = analytic_cost_model(PRESETS["llama3.1-8b"](), 32, torch.bfloat16).chunk_cost(1024)
    assert measured > 4 * analytic
    assert measured > 4 * 2**20 / 6e9  # a 4 MiB chunk read at 6 GB/s is worth starting


def test_own_profile_first_and_no_gpu_profile_for_the_cpu(tmp_path: Path) -> None:
    cfg = PRESETS["llama3.1-8b"]()
    cpu_key = config_profile_key(cfg, "cpu")
    assert cpu_key == f"{SHAPE}__cpu"
    assert find_profile(cpu_key, gpu=False) is None  # a GPU's costs say nothing of the CPU's
    assert load_cost_model(None, cfg, 32, torch.device("cpu"), torch.bfloat16).source == \
        "analytic"
    own = CostModel.load(PACKAGE_PROFILES / f"{SHAPE}__NVIDIA_H200.json")
    mine = tmp_path / f"{SHAPE}__NVIDIA_H100_80GB_HBM3.json"
    mine.write_text((PACKAGE_PROFILES / f"{SHAPE}__NVIDIA_H200.json").read_text())
    other = tmp_path / f"{SHAPE}__AAA_GPU.json"
    other.write_text(mine.read_text())
    assert find_profile(mine.stem, gpu=True, dirs=[tmp_path]) == mine
    assert find_profile(f"{SHAPE}__NVIDIA_B200", gpu=True, dirs=[tmp_path]) == other
    assert find_profile("llama-L1-H8-q1-kv1-d8-i8__NVIDIA_B200", gpu=True,
                        dirs=[tmp_path]) is None
    assert own.chunk_size == 32
    with pytest.raises(FileNotFoundError):
        load_cost_model(str(tmp_path / "missing.json"), cfg, 32, torch.device("cpu"),
                        torch.bfloat16)
