"""Multi-turn load generator: Poisson conversation arrivals, think time between turns.

Conversations arrive as a Poisson process of rate ``conv_rate`` (per second). A conversation
sends its first turn on arrival; each later turn is sent when the previous answer is back plus
a think time drawn from an exponential of mean ``think_time_s``. Each turn sends its new input
(random token ids of the dataset's length) and asks for exactly the dataset's answer length
(``ignore_eos``). The generator drives any :class:`BenchEngine` step by step on a clock: wall
time for real engines, virtual time for the simulator.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pensieve.bench.engine_api import BenchEngine, Clock
from pensieve.bench.workload import Conversation
from pensieve.core.sampling_params import SamplingParams


@dataclass
class RequestRecord:
    """One turn as the client saw it (times in seconds on the run's clock, from its start)."""

    conversation: str
    turn: int
    request_id: str
    sent: float
    input_len: int
    output_len: int
    context_len: int = 0
    first_token: float | None = None
    finished: float | None = None
    cache: dict[str, int] = field(default_factory=dict)
    error: bool = False
    """The system answered with an error: counted as never finished."""

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def normalized_latency(self) -> float | None:
        lat = self.latency
        return None if lat is None else lat / max(self.output_len, 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(latency=self.latency, ttft=self.ttft, normalized_latency=self.normalized_latency)
        return d


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    """Arrivals were generated during ``[0, duration_s)``."""
    end_s: float
    """When the run stopped (all done, or the drain limit)."""
    unfinished: int


def arrival_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson process of ``rate`` per second on ``[0, duration)``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_load(
    engine: BenchEngine,
    clock: Clock,
    conversations: list[Conversation],
    conv_rate: float,
    think_time_s: float,
    duration_s: float,
    vocab_size: int,
    seed: int = 0,
    drain_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> LoadResult:
    """Drive ``engine`` with conversations drawn in order (cycling) from ``conversations``.

    Arrivals stop at ``duration_s``; turns already under way continue until ``drain_s`` after
    that (default: ``duration_s``), then whatever is left is counted as unfinished.
    """
    rng = random.Random(seed)
    t0 = clock.now()
    arrivals = arrival_times(conv_rate, duration_s, rng)
    drain = duration_s if drain_s is None else drain_s
    stop_at = duration_s + drain
    heap: list[tuple[float, int, int]] = []  # (send time, conversation slot, turn)
    convs = [conversations[i % len(conversations)] for i in range(len(arrivals))]
    for slot, t in enumerate(arrivals):
        heapq.heappush(heap, (t, slot, 0))
    total = sum(len(c.turns) for c in convs)
    records: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    in_flight = 0
    while True:
        now = clock.now() - t0
        if now >= stop_at:
            break
        while heap and heap[0][0] <= now:
            sent, slot, k = heapq.heappop(heap)
            conv, turn = convs[slot], convs[slot].turns[k]
            rid = f"c{slot}-t{k}"
            ids = [rng.randrange(vocab_size) for _ in range(turn.input_len)]
            params = SamplingParams(max_tokens=turn.output_len, temperature=0.0,
                                    ignore_eos=True)
            records[rid] = RequestRecord(f"c{slot}", k, rid, sent, turn.input_len,
                                         turn.output_len)
            engine.add_request(rid, ids, params, arrival_time=t0 + sent,
                               conversation_id=f"{conv.conv_id}#{slot}")
            in_flight += 1
        if in_flight == 0:
            if not heap:
                break
            clock.sleep_until(t0 + min(heap[0][0], stop_at))
            continue
        for out in engine.step():
            rec = records.pop(out.request_id)
            in_flight -= 1
            if out.finish_reason == "error":
                rec.error = True
                done.append(rec)  # the conversation stops here
                continue
            rec.finished = (out.finish_time or clock.now()) - t0
            rec.first_token = (out.first_token_time - t0) if out.first_token_time else None
            rec.context_len = len(out.prompt_token_ids)
            rec.cache = dict(out.cache_stats or {})
            done.append(rec)
            slot, k = int(rec.conversation[1:]), rec.turn
            if k + 1 < len(convs[slot].turns):
                nxt = rec.finished + rng.expovariate(1.0 / think_time_s)
                heapq.heappush(heap, (nxt, slot, k + 1))
            if progress:
                progress(len(done), total)
    unfinished = list(records.values())
    done.extend(unfinished)
    return LoadResult(done, duration_s, clock.now() - t0, len(unfinished))
