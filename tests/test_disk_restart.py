"""pensieve.bench.disk_restart's comparison: the share of context from disk and the greedy
agreement, from rows as its ``continue`` writes them."""

from __future__ import annotations

from pensieve.bench.disk_restart import compare


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
