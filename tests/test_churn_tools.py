"""The churn benchmark's helpers: chat model directory, time-series plot, side-by-side summary."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> Any:
    """The benchmark script ``benchmarks/<name>.py`` (on the tests' path: pyproject)."""
    return importlib.import_module(name)


def test_chat_model_dir(tmp_path: Path) -> None:
    from pensieve.models.loader import resolve_config
    from pensieve.models.tokenizer import load_tokenizer

    d = _tool("chat_model_dir").build("llama2-13b-gqa10", str(tmp_path / "m"),
                                        {"num_hidden_layers": 1})
    cfg, path = resolve_config(str(d))
    assert path == str(d) and cfg.num_hidden_layers == 1
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (5120, 10, 32000)
    tok = load_tokenizer(str(d))
    assert len(tok) == 32000 and tok.chat_template
    with pytest.raises(SystemExit):  # 1000 tokens
        _tool("chat_model_dir").build("llama-tiny", str(tmp_path / "tiny"), tokenizer="demo")
    demo = _tool("chat_model_dir").build("llama2-13b-gqa10", str(tmp_path / "d"),
                                           tokenizer="demo")
    assert len(load_tokenizer(str(demo))) == 32000


def test_chat_model_dir_words_round_trip(tmp_path: Path) -> None:
    """With the word-level tokenizer, random answers (what dummy weights emit) re-rendered in
    the next turn's history give back the very ids generated, and chat words are one token
    each; the demo SentencePiece tokenizer breaks the first property."""
    import random

    from pensieve.bench.http_wire import CHAT_WORDS, words_text
    from pensieve.models.tokenizer import load_tokenizer

    rng = random.Random(0)

    def kept(tok, vocab: int) -> int:  # noqa: ANN001
        msgs = [{"role": "user", "content": words_text([rng.randrange(999) for _ in range(9)])}]
        ctx = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        gen = [rng.randrange(7, vocab) for _ in range(40)]
        msgs += [{"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)},
                 {"role": "user", "content": "and then"}]
        nxt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        return int(nxt[:len(ctx) + len(gen)] == ctx + gen)

    words = load_tokenizer(str(_tool("chat_model_dir").build(
        "llama2-13b-gqa10", str(tmp_path / "w"), {"num_hidden_layers": 1})))
    assert sum(kept(words, 32000) for _ in range(50)) == 50
    text = " ".join(CHAT_WORDS[:200])
    assert len(words.encode(text, add_special_tokens=False)) == 200
    demo = load_tokenizer(str(_tool("chat_model_dir").build(
        "llama2-13b-gqa10", str(tmp_path / "d"), tokenizer="demo")))
    assert sum(kept(demo, 32000) for _ in range(50)) < 25


def _series(system: str, grow: float) -> dict:
    samples = [{"t": float(t), "sessions_in_flight": 10 + grow * t, "requests_in_flight": 3,
                "gpu_blocks_used": 50.0, "gpu_blocks_total": 100.0, "cpu_blocks_used": t,
                "cpu_blocks_total": 100.0, "requests_running": 3, "requests_waiting": 0}
               for t in range(60)]
    return {"system": system, "conv_rate": 0.5, "engine": "http", "api": "chat",
            "workload": "Agentic", "tag": "t", "warmup_s": 20.0, "duration_s": 50.0,
            "drain_s": 10.0, "samples": samples}


def test_plot_timeseries(tmp_path: Path) -> None:
    ts = tmp_path / "timeseries.jsonl"
    ts.write_text("\n".join(json.dumps(_series(s, g)) for s, g in
                            (("stateless", 0.5), ("pensieve", 0.0))) + "\n")
    out = tmp_path / "churn"
    assert _tool("plot_timeseries").main([str(ts), "--out", str(out)]) == 0
    png = Path(f"{out}_timeseries.png")
    assert png.is_file() and png.stat().st_size > 10_000


def test_churn_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"conv_rate": 0.7, "engine": "http", "api": "chat", "workload": "Agentic",
            "warmup_s": 210.0, "duration_s": 420.0, "finished": 90, "requests": 100,
            "unfinished": 3, "throughput_rps": 9.1, "output_tokens_per_s": 950.0,
            "prompt_tokens_per_s": 27000.0, "normalized_latency_s_p50": 0.0187,
            "normalized_latency_s_p90": None, "ttft_s_p50": 0.05, "ttft_s_p90": 0.1,
            "latency_s_p50": 1.9, "latency_s_p90": 2.9, "mean_context_len": 2957,
            "prefill_computed_tokens": 953413, "prefill_cached_tokens": 5507331,
            "gpu_hit_rate": 0.57, "cpu_hit_rate": 0.28, "recomputed_rate": 0.04,
            "new_prompt_rate": 0.1, "steady_state": False,
            "steady": {"steady": False, "steady_within_noise": True,
                       "unsteady": ["sessions_in_flight"],
                       "halves": {"sessions_in_flight": [59.4, 68.1]}},
            "http_errors": 0, "http_history_misses": 0, "tokens_per_word": 1.0}
    pts = tmp_path / "points.jsonl"
    pts.write_text(json.dumps({**base, "system": "stateless"}) + "\n"
                   + json.dumps({**base, "system": "pensieve", "tag": "x"}) + "\n")
    mod = _tool("churn_summary")
    assert mod.main([str(pts)]) == 0
    out = capsys.readouterr().out
    assert "stateless @ 0.7/s" in out and "pensieve @ 0.7/s" in out
    assert "18.7 / inf/-" in out  # P90 unfinished in the window: infinite
    assert "953,413 / 5,507,331" in out and "59.4 -> 68.1" in out
    assert "no / yes" in out and "sessions" in out
    assert mod.main([str(pts), "--tag", "x"]) == 0
    assert "stateless" not in capsys.readouterr().out


def test_long_run_outlives_its_caller(tmp_path: Path) -> None:
    """scripts/long_run.sh: ``start`` returns at once with the command running detached in
    a copy of the tree (OUT pointing into the run directory); ``wait`` and ``collect`` say
    "running" (exit 3) until it ends, then report its exit status and copy its outputs."""
    import shutil
    import subprocess

    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "long_run.sh", tree / "scripts")
    (tree / "marker.txt").write_text("copied")
    (tree / ".git").mkdir()  # left out of the copy
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(tmp_path / "run")}
    go = tmp_path / "go"

    def sh(*args: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
        e = env | ({"OUT": str(out)} if out else {})
        return subprocess.run(["bash", str(tree / "scripts" / "long_run.sh"), *args],
                              env=e, capture_output=True, text=True, timeout=60)

    cmd = (f'while [ ! -f {go} ]; do sleep 0.1; done; cat marker.txt > "$OUT/result.txt"; '
           'echo finished; exit 4')
    started = sh("start", "bash", "-c", cmd)
    assert started.returncode == 0 and "started in" in started.stdout
    assert not (tmp_path / "run" / "tree" / ".git").exists()
    assert sh("status").stdout.startswith("running")
    assert sh("wait", "1").returncode == 3  # still running after 1 s
    assert sh("collect", out=tmp_path / "dest").returncode == 3
    assert sh("start", "true").returncode == 2  # one run at a time
    go.touch()
    done = sh("wait", "30")
    assert done.returncode == 0 and "finished" in done.stdout
    assert "ended (exit status 4)" in done.stdout
    got = sh("collect", out=tmp_path / "dest")
    assert got.returncode == 0
    assert (tmp_path / "dest" / "result.txt").read_text().strip() == "copied"
    assert "finished" in (tmp_path / "dest" / "long_run.log").read_text()


def _churn_run(root: Path, system: str, duration: float, finished: list[float | None]) -> Path:
    """A churn.tgz-like directory: one server ``A`` whose requests were sent at 0, 10, 20, ...
    and finished at ``finished`` (None: never)."""
    import gzip

    srv = root / system / "A"
    srv.mkdir(parents=True)
    point = {"system": system, "conv_rate": 1.3, "warmup_s": 20.0, "duration_s": duration,
             "throughput_rps": 0.0}
    (srv / "points.jsonl").write_text(json.dumps(point) + "\n")
    with gzip.open(srv / "requests.jsonl.gz", "wt") as f:
        for i, fin in enumerate(finished):
            sent = 10.0 * i
            f.write(json.dumps({"conversation": f"c{i}", "turn": 0, "request_id": f"c{i}-t0",
                                "sent": sent, "input_len": 10, "output_len": 10,
                                "context_len": 10, "first_token": None if fin is None else sent,
                                "finished": fin, "cache": {}, "error": False,
                                "output_tokens": None if fin is None else 10,
                                "latency": None}) + "\n")
    samples = [{"t": float(t), "requests_finished": t / 10} for t in range(0, int(duration))]
    (srv / "timeseries.jsonl").write_text(json.dumps(
        {"system": system, "warmup_s": 20.0, "duration_s": duration, "drain_s": 5.0,
         "samples": samples}) + "\n")
    return root / system


