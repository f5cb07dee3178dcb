"""The disk tier across a restart, as a client sees it (``benchmarks/disk_points.sh`` point c).

Three steps against ``pensieve serve`` (OpenAI chat API, greedy, standard library only):

    build    URL CIDS   N conversations of T turns each, W at a time (more KV than the tiers
                        hold, so most of it leaves the CPU tier for disk); their ids to CIDS
    continue URL CIDS OUT.jsonl   one more greedy turn of each, answers and the server's
                        ``pensieve.cache`` fields (as tests/test_disk_server.py reads them)
    compare  WARM.jsonl COLD.jsonl   the share of the continued turns' context that came from
                        disk (warm: the restarted disk server; cold: a server without the disk
                        tier on a copy of the same store, which recomputes) and the greedy
                        agreement of the answers; prints a summary and its JSON line
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CONTEXT_KEYS = ("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "recomputed_tokens")
"""The cache fields whose sum is the context a turn did not have to be sent afresh."""


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _prompt(rng: random.Random, words: int) -> str:
    vocab = ("the", "model", "cache", "disk", "turn", "agent", "file", "test", "build",
             "error", "line", "value", "read", "write", "tool", "call", "result", "plan")
    return " ".join(rng.choice(vocab) for _ in range(words))


def build(url: str, n: int, turns: int, words: int, max_tokens: int, workers: int,
          timeout: float) -> list[str]:
    """``n`` conversations of ``turns`` greedy turns (prompts of ``words`` words)."""
    model = _model(url)

    def one(i: int) -> str:
        rng = random.Random(i)
        cid: str | None = None
        for _ in range(turns):
            body: dict[str, Any] = {"model": model, "temperature": 0.0,
                                    "max_tokens": max_tokens,
                                    "messages": [{"role": "user",
                                                  "content": _prompt(rng, words)}]}
            if cid is not None:
                body["conversation_id"] = cid
            cid = str(_post(url, body, timeout)["conversation_id"])
        assert cid is not None
        return cid

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(n)))


def continue_all(url: str, cids: list[str], max_tokens: int, workers: int,
                 timeout: float) -> list[dict[str, Any]]:
    """One more greedy turn of each conversation: its answer and cache fields."""
    model = _model(url)

    def one(cid: str) -> dict[str, Any]:
        r = _post(url, {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
                        "conversation_id": cid, "logprobs": True, "top_logprobs": 2,
                        "messages": [{"role": "user", "content": "And then?"}]}, timeout)
        choice = r["choices"][0]
        steps = [(e["token"], e["logprob"], _margin(e))
                 for e in ((choice.get("logprobs") or {}).get("content") or [])]
        return {"conversation_id": cid, "answer": choice["message"]["content"],
                "tokens": steps, "cache": (r.get("pensieve") or {}).get("cache") or {}}

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, cids))


def _margin(entry: dict[str, Any]) -> float | None:
    """How far the chosen token's logprob is above the runner-up's (None: no runner-up)."""
    top = sorted((t["logprob"] for t in entry.get("top_logprobs") or []), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def divergence(w: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """Where two greedy answers to the same turn part: the first differing token, the
    chosen token's margin over the runner-up there in each run (a near tie, under bf16's
    rounding, flips with the batch a turn ran in; KV of other tokens would not leave the
    two runs' log-probabilities close up to there) and the largest log-probability
    difference of the tokens before it."""
    tw, tc = w.get("tokens") or [], c.get("tokens") or []
    n = next((i for i, (a, b) in enumerate(zip(tw, tc)) if a[0] != b[0]), min(len(tw), len(tc)))
    diff = max((abs(a[1] - b[1]) for a, b in zip(tw[:n], tc[:n])), default=0.0)
    margins = [t[n][2] for t in (tw, tc) if n < len(t) and t[n][2] is not None]
    return {"first_diff": n, "margin": min(margins) if margins else None,
            "max_logprob_diff_before": diff}


def compare(warm: list[dict[str, Any]], cold: list[dict[str, Any]],
            near_tie: float = 0.1) -> dict[str, Any]:
    """Disk share of the warm turns' context, and answers equal to the cold ones; for those
    that differ, where and at what margin (:func:`divergence`): ``differ_near_tie`` counts
    answers that part where the chosen token led the runner-up by less than ``near_tie``
    nats in either run."""
    by_cid = {r["conversation_id"]: r for r in cold}
    pairs = [(w, by_cid[w["conversation_id"]]) for w in warm if w["conversation_id"] in by_cid]
    context = sum(sum(int(w["cache"].get(k, 0)) for k in CONTEXT_KEYS) for w, _ in pairs)
    disk = sum(int(w["cache"].get("disk_hit_tokens", 0)) for w, _ in pairs)
    cold_disk = sum(int(c["cache"].get("disk_hit_tokens", 0)) for _, c in pairs)
    same = sum(w["answer"] == c["answer"] for w, c in pairs)
    diffs = [dict(divergence(w, c), conversation_id=w["conversation_id"],
                  disk_hit_tokens=int(w["cache"].get("disk_hit_tokens", 0)))
             for w, c in pairs if w["answer"] != c["answer"]]
    ties = sum(d["margin"] is not None and d["margin"] < near_tie for d in diffs)
    agreed = [divergence(w, c)["max_logprob_diff_before"] for w, c in pairs]
    return {"differ_near_tie": ties, "differ_not_near_tie": len(diffs) - ties,
            "near_tie_nats": near_tie,
            "max_logprob_diff_before_divergence": round(max(agreed, default=0.0), 4),
            "differences": diffs, "conversations": len(pairs), "context_tokens": context,
            "disk_hit_tokens": disk,
            "disk_share": round(disk / context, 4) if context else None,
            "cold_disk_hit_tokens": cold_disk, "greedy_agree": same,
            "greedy_agree_share": round(same / len(pairs), 4) if pairs else None}


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b, c = sub.add_parser("build"), sub.add_parser("continue")
    b.add_argument("--conversations", type=int, default=64)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--words", type=int, default=300)
    for p in (b, c):
        p.add_argument("url")
        p.add_argument("cids")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--workers", type=int, default=16)
        p.add_argument("--timeout", type=float, default=300.0)
    c.add_argument("out")  # after url and cids
    m = sub.add_parser("compare")
    m.add_argument("warm")
    m.add_argument("cold")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        cids = build(args.url, args.conversations, args.turns, args.words, args.max_tokens,
                     args.workers, args.timeout)
        with open(args.cids, "w") as f:
            f.write("\n".join(cids) + "\n")
        print(f"built {len(cids)} conversations of {args.turns} turns")
    elif args.cmd == "continue":
        with open(args.cids) as f:
            cids = [line.strip() for line in f if line.strip()]
        rows = continue_all(args.url, cids, args.max_tokens, args.workers, args.timeout)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"continued {len(rows)} conversations")
    else:
        res = compare(_read_jsonl(args.warm), _read_jsonl(args.cold))
        print(f"restart: {res['conversations']} conversations continued, "
              f"{res['disk_hit_tokens']} of {res['context_tokens']} context tokens from disk "
              f"({res['disk_share']}), greedy answers equal to the no-disk server's: "
              f"{res['greedy_agree']} ({res['greedy_agree_share']}); of the others "
              f"{res['differ_near_tie']} part at a near tie (margin < {res['near_tie_nats']}), "
              f"{res['differ_not_near_tie']} not; largest logprob difference before parting: "
              f"{res['max_logprob_diff_before_divergence']}")
        print(json.dumps({"restart": res}))
        return 0 if res["conversations"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
