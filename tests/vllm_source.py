"""vLLM's source release (its sdist on PyPI), for the peer tests that run code vLLM ships only in
its repository: ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` is not in the vllm
wheel, and it imports ``vllm.benchmarks.lib.utils``, which the sdist's pure-Python ``vllm/``
tree provides (with this venv's torch; nothing of vLLM is compiled or installed).

``pip download`` is the registry's own client, but it prepares an sdist's metadata before it
saves it, and vLLM's ``setup.py`` needs torch (this venv's), setuptools-scm and setuptools-rust
for that (the last two go into a folder of their own on ``PYTHONPATH``, not into this venv).
``VLLM_TARGET_DEVICE=empty`` keeps it from looking for CUDA, and ``VLLM_VERSION_OVERRIDE``
keeps the ``+empty`` suffix off the version, which pip would refuse as not the one asked for.
vLLM is Apache-2.0; nothing of it is kept in this repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VLLM_VERSION = "0.34.0"


def vllm_sdist_tree(dest: Path, version: str = VLLM_VERSION) -> Path:
    """The root of vLLM ``version``'s source release, unpacked under ``dest`` (downloaded from
    PyPI the first time): its ``benchmarks/`` and its ``vllm/`` package."""
    root = dest / f"vllm-{version}"
    if (root / "benchmarks" / "multi_turn").is_dir():
        return root
    tools = dest / "build-tools"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--target", str(tools), "setuptools-scm",
                    "setuptools-rust"], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(tools), "VLLM_TARGET_DEVICE": "empty",
           "VLLM_VERSION_OVERRIDE": version}
    subprocess.run([*pip, "download", f"vllm=={version}", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "-q", "-d", str(dest)],
                   check=True, timeout=600, env=env)
    with tarfile.open(dest / f"vllm-{version}.tar.gz") as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith((f"vllm-{version}/benchmarks/",
                                         f"vllm-{version}/vllm/", f"vllm-{version}/LICENSE"))]
        tar.extractall(dest, members=members, filter="data")
    return root
