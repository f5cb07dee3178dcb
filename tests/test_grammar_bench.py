"""``python benchmarks/grammar_cost.py`` on the demo tokenizer, small: the schema reaches its token
count, and the report's numbers are what it says they are."""

from __future__ import annotations

import json

from grammar_cost import big_schema, main, measure

from pensieve.models.tokenizer import load_tokenizer


def test_big_schema_reaches_its_size():
    tok = load_tokenizer("demo")
    schema = big_schema(tok, 300)
    n = len(tok.encode(json.dumps(schema)))
    assert 300 <= n < 400 and schema["required"]


def test_measure_reports_compile_and_step_costs():
    res = measure(load_tokenizer("demo"), "cpu", batch=6, constrained=2, steps=3,
                  schema_tokens=200, compiles=1)
    assert res["schema_tokens"] >= 200 and res["vocab"] == 32000
    assert res["compile_s"] > res["cached_compile_s"] > 0  # the second compile hits the LRU
    assert abs(res["added_ms"] - (res["constrained_sample_ms"] - res["sample_ms"])) < 1e-9
    assert res["fill_ms"] > 0


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["--model", "demo", "--device", "cpu", "--batch", "4",
                 "--constrained", "1", "--steps", "2", "--schema-tokens", "100",
                 "--compiles", "1", "--forward-ms", "10", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["batch"] == 4 and res["constrained"] == 1
    assert res["step_ratio"] == (10 + res["constrained_sample_ms"]) / (10 + res["sample_ms"])
