"""NVIDIA's aiperf, unmodified, against `pensieve serve` on the default model (CPU): a
multi-turn chat load (aiperf re-sends each conversation's history), then a check that every
request succeeded and that the later turns hit the KV cache (the server's
``pensieve_prompt_tokens_total`` by source).

    python scripts/peer_aiperf.py [--venv /tmp/aiperf-venv] [--out DIR]

aiperf lives in a virtual environment of its own (``--venv``; made with ``pip install aiperf``
when it has none): its pinned dependencies (prometheus-client, psutil, rich, pandas, ...)
conflict with this project's, so it is not a dev dependency. Its flags are its defaults plus
``--tokenizer`` (the default model's directory), the endpoint, and a small load that a 2-core
machine finishes in about a minute: ``--conversation-num 2 --conversation-turn-mean 3
--request-count 6 --concurrency 2 --synthetic-input-tokens-mean 100 --output-tokens-mean 16``.
Exits 1 if a request failed or no turn hit the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from cpu_contention import start_server

from pensieve.models.builtin import ensure_smollm2_checkpoint, smollm2_dir


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """The server's ``pensieve_prompt_tokens_total`` counters, by source."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pensieve_prompt_tokens_total{source="):
            source = line.split('"')[1]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


@contextlib.contextmanager
def default_model_server(name: str) -> Iterator[tuple[str, str, Path]]:
    """``pensieve serve`` on the default model (its checkpoint made first if needed) in a
    temporary directory: yields its URL, its model id and the directory; stopped after."""
    ensure_smollm2_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc, url = start_server(name, {}, work, None, ["--max-model-len", "2048"])
        try:
            yield url, httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"], work
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def ensure_venv(venv: Path) -> Path:
    """The ``aiperf`` executable of ``venv``, installing it there first if needed."""
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf"], check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "aiperf-venv")
    ap.add_argument("--out", type=Path, default=None, help="aiperf's artifact directory")
    args = ap.parse_args()
    exe = ensure_venv(args.venv)
    with default_model_server("aiperf") as (url, model, work):
        art = args.out or work / "aiperf"
        cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type",
               "chat", "--streaming", "--tokenizer", str(smollm2_dir()),
               "--conversation-num", "2", "--conversation-turn-mean", "3",
               "--request-count", "6", "--concurrency", "2",
               "--synthetic-input-tokens-mean", "100", "--output-tokens-mean", "16",
               "--artifact-dir", str(art)]
        print(" ".join(cmd), flush=True)
        rc = subprocess.run(cmd, capture_output=True, text=True, timeout=900).returncode
        report = json.loads((art / "profile_export_aiperf.json").read_text())
        sources = prompt_tokens_by_source(url)
    count = report["request_count"]["avg"]
    errors = report["error_summary"]
    hit = sources.get("gpu_hit", 0) + sources.get("cpu_hit", 0)
    print(json.dumps({"aiperf_rc": rc, "aiperf_version": report["aiperf_version"],
                      "requests": count, "errors": errors, "prompt_tokens": sources}))
    ok = rc == 0 and not errors and count == 6 and hit > 0
    print("ok" if ok else "FAILED: a request failed or no turn hit the cache")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
