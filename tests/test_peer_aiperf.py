"""NVIDIA's aiperf, unmodified, with its defaults plus ``--tokenizer``, against ``pensieve
serve`` on the default model (``scripts/peer_aiperf.py``): a multi-turn chat load in which
aiperf re-sends each conversation's history. Every request must succeed and the later turns
must find their history in the cache (the server's ``pensieve_prompt_tokens_total`` by
source).

aiperf pins versions of prometheus-client, psutil, rich and pandas that conflict with this
project's, so it gets a virtual environment of its own, installed from the package registry
into a temporary directory (about 60 s and 1.2 GB on a 2-core machine; the load itself ~25 s).
Marked slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent.parent / "scripts" / "peer_aiperf.py"


def test_aiperf_multi_turn_chat_hits_the_cache(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--venv", str(tmp_path / "venv"),
                          "--out", str(tmp_path / "artifacts")],
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    report = json.loads(next(line for line in run.stdout.splitlines()
                             if line.startswith('{"aiperf_rc"')))
    assert report["aiperf_rc"] == 0 and report["requests"] == 6 and not report["errors"], report
    tokens = report["prompt_tokens"]
    assert tokens["gpu_hit"] + tokens["cpu_hit"] > 0, tokens  # later turns reuse earlier KV
    export = json.loads((tmp_path / "artifacts" / "profile_export_aiperf.json").read_text())
    assert export["request_count"]["avg"] == 6, export["request_count"]
