"""lm-evaluation-harness, unmodified, against the server: ``local-completions`` on a local
multiple-choice task (``tests/data/lm_eval_mc``, 6 questions, ``--limit 5``) runs end to end
with loglikelihood scores. Its requests are ``echo`` + ``logprobs: 1`` + ``max_tokens: 1``
with batched token-id prompts (``[[ids], ...]``), scored from the prefill's own logits (those
match HF transformers to 1e-3: tests/test_completions_echo.py). Marked slow; lm-eval is in
the dev extra."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pensieve.models.builtin import ensure_smollm2_checkpoint

MODEL = "smollm2-135m-instruct"
TASK_DIR = Path(__file__).parent / "data" / "lm_eval_mc"

pytestmark = pytest.mark.slow


def test_lm_eval_local_completions_multiple_choice(tmp_path, smollm2_server):
    srv = smollm2_server  # the default model's server of this test process (conftest.py)
    before = srv.client().get("/usage", cast_to=object)["requests"]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = (TASK_DIR / "pensieve_mc.yaml").read_text().replace(
        "PLACEHOLDER", str(TASK_DIR / "mc.jsonl"))
    (tasks / "pensieve_mc.yaml").write_text(yaml)
    args = (f"model={MODEL},base_url={srv.url}/v1/completions,num_concurrent=1,"
            f"max_retries=1,tokenizer_backend=huggingface,"
            f"tokenizer={ensure_smollm2_checkpoint()}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         args, "--tasks", "pensieve_mc", "--include_path", str(tasks), "--limit", "5",
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        capture_output=True, text=True, timeout=500, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    usage = srv.client().get("/usage", cast_to=object)
    results = next((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"]["pensieve_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_pensieve_mc*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == 5
    for s in samples:
        lls = [float(r[0][0]) for r in s["resps"]]  # (loglikelihood, is_greedy), as text
        assert len(lls) == 3 and all(math.isfinite(x) and x < 0 for x in lls), s["resps"]
    assert usage["requests"] - before >= 15  # one scored continuation per choice
