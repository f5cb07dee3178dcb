"""benchmarks/disk_restart.py's comparison: the share of context from disk and the greedy
agreement, from rows as its ``continue`` writes them."""

from __future__ import annotations

from disk_restart import compare


def _row(cid: str, answer: str, disk: int, recomputed: int, gpu: int = 0) -> dict:
    return {"conversation_id": cid, "answer": answer,
            "cache": {"disk_hit_tokens": disk, "recomputed_tokens": recomputed,
                      "gpu_hit_tokens": gpu, "cpu_hit_tokens": 0}}


def test_compare_counts_disk_share_and_equal_answers() -> None:
    warm = [_row("a", "x y", 90, 10), _row("b", "z", 40, 0, gpu=60), _row("c", "q", 0, 5)]
    cold = [_row("b", "z", 0, 100), _row("a", "x w", 0, 100)]  # no "c": not compared
    res = compare(warm, cold)
    assert res["conversations"] == 2
    assert res["context_tokens"] == 200 and res["disk_hit_tokens"] == 130
    assert res["disk_share"] == 0.65 and res["cold_disk_hit_tokens"] == 0
    assert res["greedy_agree"] == 1 and res["greedy_agree_share"] == 0.5
    assert compare([], [])["disk_share"] is None


def test_compare_says_where_answers_part_and_at_what_margin() -> None:
    def tok(t: str, lp: float, margin: float) -> list:
        return [t, lp, margin]

    warm = [_row("a", "x y", 90, 10), _row("b", "p q", 90, 10)]
    cold = [_row("a", "x w", 0, 100), _row("b", "p r", 0, 100)]
    warm[0]["tokens"] = [tok("x", -0.50, 1.0), tok("y", -0.70, 0.02)]
    cold[0]["tokens"] = [tok("x", -0.52, 1.0), tok("w", -0.69, 0.03)]
    warm[1]["tokens"] = [tok("p", -0.10, 2.0), tok("q", -0.20, 3.0)]
    cold[1]["tokens"] = [tok("p", -0.10, 2.0), tok("r", -0.30, 0.5)]
    res = compare(warm, cold)
    assert res["greedy_agree"] == 0
    assert res["differ_near_tie"] == 1 and res["differ_not_near_tie"] == 1
    a, b = sorted(res["differences"], key=lambda d: d["conversation_id"])
    assert a["first_diff"] == 1 and a["margin"] == 0.02
    assert abs(a["max_logprob_diff_before"] - 0.02) < 1e-9
    assert b["first_diff"] == 1 and b["margin"] == 0.5 and b["disk_hit_tokens"] == 90
    assert abs(res["max_logprob_diff_before_divergence"] - 0.02) < 1e-9
