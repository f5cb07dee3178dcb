"""vLLM's multi-turn benchmark client (``benchmarks/multi_turn/benchmark_serving_multi_turn.py``
of vLLM's source release, tests/vllm_source.py), unmodified, against ``pensieve serve`` on the
default model, with ``--send-conversation-id`` and its default flags (one client, streaming,
each answer's length from the dataset).

It sends every turn's whole history with ``conversation_id`` in the body and ``X-Session-ID``
as a header, naming each conversation ``CONV_ID_<n>`` from its first turn. Every request must
succeed, each conversation must be stored once under its name with its history not doubled,
and the later turns must find their history in the cache (``/v1/usage``).

The input is a synthetic-conversation configuration in the client's own format (its
``generate_multi_turn.json``, scaled down for a 2-core CPU, with this repository's README as the
text instead of a Project Gutenberg download). Marked slow: about 20 s to fetch vLLM's sdist and
30 s to run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_util import Server
from vllm_source import vllm_sdist_tree

from pensieve.config import DEFAULT_MODEL
from pensieve.models.builtin import ensure_smollm2_checkpoint

pytestmark = pytest.mark.slow

CONVERSATIONS = 3
MESSAGES = 6  # user and assistant messages of a conversation: 3 requests each
README = Path(__file__).parent.parent / "README.md"


def _config(path: Path) -> Path:
    conf = {
        "filetype": "generate_conversations",
        "num_conversations": CONVERSATIONS,
        "text_files": [str(README)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": MESSAGES},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 50},
            "prefix_num_tokens": {"distribution": "constant", "value": 150},
            "num_tokens": {"distribution": "uniform", "min": 30, "max": 50},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 12, "max": 20}},
    }
    path.write_text(json.dumps(conf, indent=2))
    return path


def test_vllm_multi_turn_client_with_conversation_ids(tmp_path_factory, smollm2_server: Server):
    tree = vllm_sdist_tree(tmp_path_factory.mktemp("vllm-src"))
    work = tmp_path_factory.mktemp("vllm-multi-turn")
    client = smollm2_server.client()
    before = client.get("/usage", cast_to=object)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / "multi_turn" /
                             "benchmark_serving_multi_turn.py"),
         "--input-file", str(_config(work / "conf.json")),
         "--model", ensure_smollm2_checkpoint(), "--served-model-name", DEFAULT_MODEL,
         "--url", smollm2_server.url, "--send-conversation-id"],
        capture_output=True, text=True, timeout=600, env=env, cwd=work)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    after = client.get("/usage", cast_to=object)
    requests = CONVERSATIONS * MESSAGES // 2
    assert "Received HTTP status" not in out, out[-5000:]
    assert f"num_successes={requests}, num_failures=0" in out, out[-5000:]
    assert (f"successfully finished {CONVERSATIONS} out of {CONVERSATIONS} conversations"
            in out), out[-5000:]
    assert re.search(r"requests_per_sec = [0-9.]+", out), out[-3000:]
    # every turn of each conversation is in the one conversation its id names, once
    for n in range(CONVERSATIONS):
        conv = client.get(f"/conversations/CONV_ID_{n}", cast_to=object)
        assert len(conv["messages"]) == MESSAGES and len(conv["turns"]) == MESSAGES // 2, conv
        assert len(conv["token_ids"]) < 600, conv  # the history re-sent with the id is not doubled
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert after["requests"] - before["requests"] == requests, (before, after)
    # turns 2 and 3 of each conversation find turn 1's (and 2's) history in the cache
    assert cached >= prompt // 2, (before, after)
