"""Workloads for the multi-turn benchmark: ShareGPT streaming parse, turn pairing, filters,
synthetic UltraChat, Table 2 statistics, and the lengths cache. CPU only, no transformers."""

from __future__ import annotations

import json

import pytest

from pensieve.bench import sharegpt as sg
from pensieve.bench import workload as wl
from pensieve.bench.sharegpt import (
    ShareGPTReadStats,
    iter_sharegpt,
    pair_turns,
    sharegpt_workload,
)
from pensieve.bench.workload import (
    PAPER_TABLE2,
    Conversation,
    Turn,
    Workload,
    load_workload,
    save_workload,
    ultrachat_synthetic,
    workload_stats,
)


class WhitespaceTokenizer:
    """Called like a Hugging Face tokenizer; one token per whitespace-separated word."""

    name_or_path = "whitespace"

    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False
        assert isinstance(texts, list)
        return {"input_ids": [list(range(len(t.split()))) for t in texts]}


def msg(role, text):
    return {"from": role, "value": text}


def conv(cid, *pairs):
    return {"id": cid, "conversations": [msg(r, t) for r, t in pairs]}


CONVS = [
    conv("a_0", ("human", "hello there"), ("gpt", "hi how are you")),
    conv("b_0", ("human", "one two three"), ("gpt", "four"), ("human", "five six"),
         ("gpt", "seven eight nine ten")),
    {"id": "c_0", "conversations": []},
    conv("d_0", ("human", "unicode: \u00e9\u00e8 \u4e2d\u6587 \U0001f600"), ("gpt", "ok ok")),
]


def write_pretty(path, objs):
    text = json.dumps(objs, indent=2, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return text


def test_complete_file(tmp_path):
    p = tmp_path / "full.json"
    write_pretty(p, CONVS)
    st = ShareGPTReadStats()
    got = list(iter_sharegpt(p, st, chunk_size=7))  # tiny chunks: elements span many reads
    assert got == CONVS
    assert st.conversations_read == 4 and not st.truncated and st.error is None
    assert st.bytes_read == p.stat().st_size


def test_compact_and_empty_arrays(tmp_path):
    p = tmp_path / "compact.json"
    p.write_text(json.dumps(CONVS, separators=(",", ":")))
    assert list(iter_sharegpt(p, chunk_size=5)) == CONVS
    e = tmp_path / "empty.json"
    e.write_text(" [ ] \n")
    st = ShareGPTReadStats()
    assert list(iter_sharegpt(e, st)) == [] and not st.truncated


@pytest.mark.parametrize("chunk", [3, 64, 1 << 20])
def test_truncated_mid_object(tmp_path, chunk):
    full = json.dumps(CONVS, indent=2, ensure_ascii=False)
    # Cut inside the last object, in the middle of its multi-byte characters' string.
    cut_char = full.index("\u4e2d") + 1
    data = full[:cut_char].encode("utf-8")
    data = data + "\U0001f600".encode()[:2]  # and split a 4-byte character
    p = tmp_path / "cut.json"
    p.write_bytes(data)
    st = ShareGPTReadStats()
    got = list(iter_sharegpt(p, st, chunk_size=chunk))
    assert got == CONVS[:3]
    assert st.truncated and st.conversations_read == 3
    assert "incomplete" in st.error


def test_truncated_between_elements(tmp_path):
    full = json.dumps(CONVS[:2], indent=2)
    p = tmp_path / "cut2.json"
    p.write_text(full[: full.rindex("]")].rstrip() + ",\n  ")  # ends after a comma
    st = ShareGPTReadStats()
    assert list(iter_sharegpt(p, st)) == CONVS[:2]
    assert st.truncated
    p.write_text(full[: full.rindex("]")])  # no closing bracket
    st = ShareGPTReadStats()
    assert list(iter_sharegpt(p, st)) == CONVS[:2]
    assert st.truncated


def test_non_objects_skipped_and_bad_file(tmp_path):
    p = tmp_path / "mixed.json"
    p.write_text(json.dumps([CONVS[0], 5, "x", None, CONVS[1]]))
    st = ShareGPTReadStats()
    assert list(iter_sharegpt(p, st, chunk_size=4)) == [CONVS[0], CONVS[1]]
    assert st.skipped_non_objects == 3 and st.conversations_read == 2
    bad = tmp_path / "obj.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError):
        list(iter_sharegpt(bad))


def test_pair_turns_basic():
    assert pair_turns([msg("human", "q"), msg("gpt", "a"), msg("human", "q2"),
                       msg("gpt", "a2")]) == [("q", "a"), ("q2", "a2")]


def test_pair_turns_edge_cases():
    # Leading assistant messages are dropped.
    assert pair_turns([msg("gpt", "intro"), msg("gpt", "more"), msg("human", "q"),
                       msg("gpt", "a")]) == [("q", "a")]
    # Consecutive same-role messages merge (both sides).
    assert pair_turns([msg("human", "q1"), msg("user", "q2"), msg("chatgpt", "a1"),
                       msg("bard", "a2")]) == [("q1\n\nq2", "a1\n\na2")]
    # A trailing unanswered user message is dropped.
    assert pair_turns([msg("human", "q"), msg("gpt", "a"), msg("human", "unanswered")]) == [
        ("q", "a")]
    # Unknown roles and empty texts are ignored (so neighbours of the same role merge).
    assert pair_turns([msg("system", "sys"), msg("human", "q"), msg("tool", "x"),
                       msg("gpt", "a"), msg("human", "  "), msg("bing", "b")]) == [
        ("q", "a\n\nb")]
    # Roles are case-insensitive; OpenAI-style role/content also accepted.
    assert pair_turns([{"role": "User", "content": "q"}, {"role": "assistant", "content": "a"}]
                      ) == [("q", "a")]
    # Nothing usable.
    assert pair_turns([msg("gpt", "a"), msg("human", "q")]) == []
    assert pair_turns([]) == []
    assert pair_turns([msg("human", None), "junk", msg(None, "x")]) == []


def test_sharegpt_workload_counts_and_filter(tmp_path):
    objs = [
        conv("ok_0", ("gpt", "leading dropped"), ("human", "a b c"), ("gpt", "d e"),
             ("human", "f"), ("gpt", "g h i j"), ("human", "dangling")),
        conv("empty_0", ("gpt", "only assistant")),
        conv("long_0", ("human", "w " * 10), ("gpt", "x " * 11)),  # 21 tokens
        conv("edge_0", ("human", "w " * 10), ("gpt", "x " * 10)),  # exactly 20 tokens
        conv("cut_0", ("human", "q"), ("gpt", "a")),
    ]
    full = json.dumps(objs, indent=1)
    p = tmp_path / "sg.json"
    p.write_text(full[: full.index('"cut_0"') + 12])  # cut inside the last object
    w = sharegpt_workload(p, tokenizer=WhitespaceTokenizer(), max_context=20,
                          batch_conversations=2, progress=False, verbose=False)
    assert [c.conv_id for c in w.conversations] == ["ok_0", "edge_0"]
    assert w.conversations[0].turns == [Turn(3, 2), Turn(1, 4)]
    assert w.conversations[1].turns == [Turn(10, 10)]
    c = w.counts
    assert (c["read"], c["kept"], c["dropped_too_long"], c["dropped_empty"]) == (4, 2, 1, 1)
    assert c["truncated"] is True
    # No limit keeps the long one; max_conversations limits what is read.
    w2 = sharegpt_workload(p, tokenizer=WhitespaceTokenizer(), max_context=None,
                           progress=False, verbose=False)
    assert w2.counts["kept"] == 3
    w3 = sharegpt_workload(p, tokenizer=WhitespaceTokenizer(), max_conversations=2,
                           progress=False, verbose=False)
    assert w3.counts["read"] == 2 and [x.conv_id for x in w3.conversations] == ["ok_0"]


def test_lengths_clipped_to_one(tmp_path):
    class ZeroTok:
        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[] for _ in texts]}

    p = tmp_path / "z.json"
    p.write_text(json.dumps([conv("z", ("human", "q"), ("gpt", "a"))]))
    w = sharegpt_workload(p, tokenizer=ZeroTok(), progress=False, verbose=False)
    assert w.conversations[0].turns == [Turn(1, 1)]


def test_ultrachat_synthetic_means():
    w = ultrachat_synthetic(200_000, seed=1234)
    s = workload_stats(w)
    paper = PAPER_TABLE2["UltraChat"]
    assert s["mean_turns"] == pytest.approx(paper["mean_turns"], rel=0.01)
    assert s["mean_input_tokens"] == pytest.approx(paper["mean_input_tokens"], rel=0.02)
    assert s["mean_output_tokens"] == pytest.approx(paper["mean_output_tokens"], rel=0.02)
    assert all(t.input_len >= 1 and t.output_len >= 1 for c in w.conversations for t in c.turns)
    assert min(len(c.turns) for c in w.conversations) >= 1
    assert s["max_final_context"] <= 16384


def test_ultrachat_deterministic_and_filtered():
    a = ultrachat_synthetic(500, seed=7)
    b = ultrachat_synthetic(500, seed=7)
    c = ultrachat_synthetic(500, seed=8)
    assert [x.turns for x in a.conversations] == [x.turns for x in b.conversations]
    assert [x.turns for x in a.conversations] != [x.turns for x in c.conversations]
    small = ultrachat_synthetic(2000, seed=7, max_context=600)
    assert all(x.total_tokens <= 600 for x in small.conversations)
    assert small.counts["dropped_too_long"] == 2000 - len(small.conversations) > 0


def test_workload_stats_exact():
    w = Workload("t", [
        Conversation("a", [Turn(10, 100)]),
        Conversation("b", [Turn(20, 200), Turn(30, 300)]),
        Conversation("c", [Turn(1, 2), Turn(3, 4), Turn(5, 6)]),
        Conversation("d", [Turn(4, 4)] * 6),
    ])
    s = workload_stats(w)
    assert s["conversations"] == 4
    assert s["total_turns"] == 12
    assert s["mean_turns"] == pytest.approx(3.0)
    assert s["mean_input_tokens"] == pytest.approx((10 + 50 + 9 + 24) / 12)
    assert s["mean_output_tokens"] == pytest.approx((100 + 500 + 12 + 24) / 12)
    assert s["mean_final_context"] == pytest.approx((110 + 550 + 21 + 48) / 4)
    assert s["max_final_context"] == 550
    assert s["p50_turns"] == 2  # nearest rank over [1, 2, 3, 6]
    assert s["p90_turns"] == 6


def test_workload_stats_empty():
    s = workload_stats(Workload("e", []))
    assert s["conversations"] == 0 and s["mean_turns"] != s["mean_turns"]  # nan


@pytest.mark.parametrize("name", ["lens.json.gz", "lens.json"])
def test_cache_round_trip(tmp_path, name):
    w = Workload("ShareGPT", [Conversation("x_0", [Turn(3, 5), Turn(7, 11)]),
                              Conversation("y_1", [Turn(1, 1)])],
                 source="src", notes="n", counts={"read": 3, "kept": 2, "truncated": True})
    p = save_workload(w, tmp_path / "sub" / name)
    back = load_workload(p)
    assert back.name == "ShareGPT" and back.source == "src" and back.notes == "n"
    assert back.counts == w.counts
    assert [(c.conv_id, c.turns) for c in back.conversations] == [
        (c.conv_id, c.turns) for c in w.conversations]
    if name.endswith(".gz"):
        assert p.read_bytes()[:2] == b"\x1f\x8b"
        assert save_workload(w, tmp_path / "again.json.gz").read_bytes() == p.read_bytes()


def test_cli_with_cache(tmp_path, capsys):
    w = Workload("ShareGPT", [Conversation("a", [Turn(10, 100), Turn(20, 200)]),
                              Conversation("b", [Turn(30, 30000)])])
    p = save_workload(w, tmp_path / "c.json.gz")
    assert wl.main(["--sharegpt", str(p), "--ultrachat-n", "1000"]) == 0
    out = capsys.readouterr().out
    assert "ShareGPT (ours)" in out and "UltraChat (paper)" in out and "48,159" in out
    assert "mean turns / conversation" in out
    # The over-long cached conversation is left out under the default cap.
    assert wl.main(["--sharegpt", str(p), "--ultrachat-n", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ours"]["ShareGPT"]["conversations"] == 1
    assert doc["ours"]["ShareGPT"]["mean_input_tokens"] == 15


def test_cli_parses_raw_file_and_writes_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sg, "load_default_tokenizer", WhitespaceTokenizer)
    p = tmp_path / "raw.json"
    p.write_text(json.dumps(CONVS))
    out_cache = tmp_path / "out.json.gz"
    assert wl.main(["--sharegpt", str(p), "--ultrachat-n", "0", "--write-cache",
                    str(out_cache), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ours"]["ShareGPT"]["conversations"] == 3
    assert len(load_workload(out_cache).conversations) == 3


def test_merge_split_pieces(tmp_path):
    objs = [
        conv("abc_0", ("human", "q1 q1"), ("gpt", "a1 a1 a1")),
        # The split cut the answer: the next piece starts with the rest of it.
        conv("abc_1", ("gpt", "a1b"), ("human", "q2"), ("gpt", "a2 a2")),
        conv("abc_2", ("human", "q3")),  # unanswered at the very end
        conv("x_y_0", ("human", "z"), ("gpt", "z")),
        conv("noid", ("human", "n"), ("gpt", "n n")),
    ]
    p = tmp_path / "split.json"
    p.write_text(json.dumps(objs))
    kw = dict(tokenizer=WhitespaceTokenizer(), progress=False, verbose=False)
    plain = sharegpt_workload(p, **kw)
    assert [c.conv_id for c in plain.conversations] == ["abc_0", "abc_1", "x_y_0", "noid"]
    assert plain.conversations[1].turns == [Turn(1, 2)]  # leading gpt piece dropped
    assert plain.counts["dropped_empty"] == 1
    merged = sharegpt_workload(p, merge_split=True, **kw)
    assert [c.conv_id for c in merged.conversations] == ["abc", "x_y", "noid"]
    assert merged.conversations[0].turns == [Turn(2, 4), Turn(1, 2)]
    assert merged.counts["read"] == 5 and merged.counts["conversations"] == 3
    assert merged.counts["dropped_empty"] == 0
    # max_conversations counts objects read; the pending merged conversation is still emitted.
    first2 = sharegpt_workload(p, merge_split=True, max_conversations=2, **kw)
    assert [c.turns for c in first2.conversations] == [[Turn(2, 4), Turn(1, 2)]]
