"""SGLang's ``bench_serving`` (``python -m sglang.bench_serving --backend sglang-oai-chat``),
unmodified, against ``pensieve serve`` on the default model (CPU): its generated-shared-prefix
dataset over two turns (each second turn re-sends the first turn's history, each group shares a
system prompt), then a check that every request succeeded and that the cache was hit (the
server's ``/v1/usage`` and ``pensieve_prompt_tokens_total`` by source).

    python scripts/peer_sglang_bench.py [--venv /tmp/sglang-bench-venv] [--out FILE]

SGLang lives in a virtual environment of its own (``--venv``; made on first use). Its wheel pins
torch 2.14.1 and many GPU packages (sglang-kernel, flashinfer, CUDA Python, ...) that the
benchmark client does not use, so the venv gets ``sglang==0.5.23`` with ``--no-deps`` and the
packages its client imports (:data:`CLIENT_DEPS`, found by running it until nothing was
missing), torch held by a constraint. The client imports ``sglang.srt`` (for two constants),
which imports torchvision unconditionally (``sglang/srt/multimodal/internvl_utils.py``), and
PyPI's torchvision does not load beside the CPU torch 2.13.0 on this disk ("operator
torchvision::nms does not exist"), so the venv takes torch 2.14.1 with torchvision 0.29.1, which
pip also takes from this disk on Python 3.11 (a CUDA build; 6.3 GB in the venv, 5-10
minutes to install on a 2-core machine). Too big for CI: run by hand.

Flags: the endpoint (``--base-url``), ``--model`` and ``--tokenizer`` (the default model's
directory: nothing comes from a hub), and a load a 2-core machine runs in about half a minute:
``--dataset-name generated-shared-prefix`` (``sharegpt``, the default, is a download) with 2
groups of 2 prompts, a 128-token system prompt, 32-token questions, 16 tokens out, 2 turns, and
``--max-concurrency 2`` (with every request at once, none finds another's prefix computed).
Exits 1 if a request failed or nothing hit the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from peer_aiperf import default_model_server, prompt_tokens_by_source

from pensieve.models.builtin import smollm2_dir

SGLANG = "sglang==0.5.23"
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
CLIENT_DEPS = [
    "aiohttp", "msgspec", "numpy", "orjson", "requests", "tqdm", "transformers==5.19.0",
    "psutil", "pyzmq", "pybase64", "pillow", "triton", "starlette", "IPython", "datasets",
    "apache-tvm-ffi==0.1.11", "sentencepiece", "compressed-tensors", "gguf",
]
"""What ``sglang.bench_serving`` imports, with SGLang 0.5.23's own pins where it sets them."""


def ensure_venv(venv: Path) -> Path:
    """The Python of ``venv``, with SGLang installed there first if needed."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "sglang-installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *TORCH], check=True)
        subprocess.run([*pip, "--no-deps", SGLANG], check=True)
        constraint = venv / "torch-constraint.txt"
        constraint.write_text("\n".join(TORCH) + "\n")
        subprocess.run([*pip, "-c", str(constraint), *CLIENT_DEPS], check=True)
        (venv / "bin" / "sglang-installed").write_text(SGLANG + "\n")
    return python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path,
                    default=Path(tempfile.gettempdir()) / "sglang-bench-venv")
    ap.add_argument("--out", type=Path, default=None, help="SGLang's result file (JSON lines)")
    args = ap.parse_args()
    python = ensure_venv(args.venv)
    groups, per_group, turns = 2, 2, 2
    with default_model_server("sglang-bench") as (url, model, work):
        out = args.out or work / "sglang-bench.jsonl"
        cmd = [str(python), "-m", "sglang.bench_serving", "--backend", "sglang-oai-chat",
               "--base-url", url, "--model", model, "--tokenizer", str(smollm2_dir()),
               "--dataset-name", "generated-shared-prefix",
               "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group),
               "--gsp-system-prompt-len", "128", "--gsp-question-len", "32",
               "--gsp-output-len", "16", "--gsp-num-turns", str(turns),
               "--num-prompts", str(groups * per_group), "--max-concurrency", "2",
               "--output-file", str(out)]
        print(" ".join(cmd), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        summary = [line for line in run.stdout.splitlines()
                   if ":" in line and not line.startswith(("Namespace", "benchmark_args"))]
        print("\n".join(summary[-45:]))
        if run.returncode != 0:
            print(run.stderr[-5000:])
        report = (json.loads(out.read_text().splitlines()[-1])
                  if run.returncode == 0 else {})
        usage = httpx.get(url + "/v1/usage", timeout=10).json()
        sources = prompt_tokens_by_source(url)
    requests = groups * per_group * turns
    completed = report.get("completed", 0)
    print(json.dumps({"sglang_rc": run.returncode, "completed": completed, "usage": usage,
                      "prompt_tokens": sources}))
    ok = run.returncode == 0 and completed == requests and usage["cached_prompt_tokens"] > 0
    print("ok" if ok else "FAILED: a request failed or no prompt token hit the cache")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
