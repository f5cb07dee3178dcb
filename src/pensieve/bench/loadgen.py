"""Multi-turn load generator: Poisson conversation arrivals, think time between turns.

Conversations arrive as a Poisson process of rate ``conv_rate`` (per second). A conversation
sends its first turn on arrival; each later turn is sent when the previous answer is back plus
a think time drawn from an exponential of mean ``think_time_s``. Each turn sends its new input
(random token ids of the dataset's length) and asks for exactly the dataset's answer length
(``ignore_eos``). The generator drives any :class:`BenchEngine` step by step on a clock: wall
time for real engines, virtual time for the simulator.

A turn's token ids and the think time after it come from a random generator of their own,
seeded by ``(seed, conversation slot, turn)``: every system driven with the same seed gets the
same conversations, the same prompts and the same think times, whatever order its turns
finish in.

Steady state: every ``sample_interval_s`` (1 s by default) the generator records a sample of
the run (:attr:`LoadResult.samples`): sessions in flight (arrived, last turn not yet answered),
requests in flight (sent, not yet answered), running totals of sessions, requests sent and
finished, and the engine's state from :func:`~pensieve.bench.engine_api.engine_probe` (KV
blocks used per tier, requests running and waiting, swap and drop totals).
:func:`pensieve.bench.metrics.steady_state` compares the window's two halves.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pensieve.bench.engine_api import BenchEngine, Clock, engine_probe
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
    output_tokens: int | None = None
    """Tokens the system generated (its ``usage`` over HTTP); ``output_len`` is what was
    asked for. They differ only if the system stopped early (no ``ignore_eos``)."""

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def normalized_latency(self) -> float | None:
        """Latency per generated token (per asked-for token if the count is unknown)."""
        lat = self.latency
        n = self.output_tokens if self.output_tokens else self.output_len
        return None if lat is None else lat / max(n, 1)

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
    samples: list[dict[str, float]] = field(default_factory=list)
    """One dict a ``sample_interval_s``: ``t`` (seconds from the start) and the run's state
    (see the module doc)."""


def arrival_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson process of ``rate`` per second on ``[0, duration)``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


_EPS = 1e-9


def _turn_rng(seed: int, slot: int, turn: int, what: str) -> random.Random:
    """The generator of one turn's prompt or think time (a str seed: stable across runs)."""
    return random.Random(f"{seed}:{slot}:{turn}:{what}")


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
    sample_interval_s: float | None = 1.0,
) -> LoadResult:
    """Drive ``engine`` with conversations drawn in order (cycling) from ``conversations``.

    Arrivals stop at ``duration_s``; turns already under way continue until ``drain_s`` after
    that (default: ``duration_s``), then whatever is left is counted as unfinished. Samples
    of the run's state are taken every ``sample_interval_s`` (None: none).
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
    sessions = 0  # arrived, last turn not answered yet
    started = sent_n = finished_n = 0
    samples: list[dict[str, float]] = []
    next_sample = 0.0 if sample_interval_s else math.inf

    def sample(now: float) -> None:
        nonlocal next_sample
        s: dict[str, float] = {"t": round(now, 3), "sessions_in_flight": sessions,
                               "requests_in_flight": in_flight, "sessions_started": started,
                               "requests_sent": sent_n, "requests_finished": finished_n}
        s.update(engine_probe(engine))
        samples.append(s)
        assert sample_interval_s
        while next_sample <= now:
            next_sample += sample_interval_s

    while True:
        # the clock's reading minus t0 may fall a rounding error short of the time slept to
        now = clock.now() - t0 + _EPS
        if now >= stop_at:
            break
        while heap and heap[0][0] <= now:
            sent, slot, k = heapq.heappop(heap)
            conv, turn = convs[slot], convs[slot].turns[k]
            rid = f"c{slot}-t{k}"
            trng = _turn_rng(seed, slot, k, "prompt")
            ids = [trng.randrange(vocab_size) for _ in range(turn.input_len)]
            params = SamplingParams(max_tokens=turn.output_len, temperature=0.0,
                                    ignore_eos=True)
            records[rid] = RequestRecord(f"c{slot}", k, rid, sent, turn.input_len,
                                         turn.output_len)
            engine.add_request(rid, ids, params, arrival_time=t0 + sent,
                               conversation_id=f"{conv.conv_id}#{slot}")
            in_flight += 1
            sent_n += 1
            if k == 0:
                sessions += 1
                started += 1
        if now >= next_sample:  # after the sends that were due
            sample(now)
        if in_flight == 0:
            if not heap:
                break
            clock.sleep_until(t0 + min(heap[0][0], stop_at, next_sample))
            continue
        for out in engine.step():
            rec = records.pop(out.request_id)
            in_flight -= 1
            finished_n += 1
            slot, k = int(rec.conversation[1:]), rec.turn
            if out.finish_reason == "error":
                rec.error = True
                done.append(rec)  # the conversation stops here
                sessions -= 1
                continue
            rec.finished = (out.finish_time or clock.now()) - t0
            rec.first_token = (out.first_token_time - t0) if out.first_token_time else None
            rec.context_len = len(out.prompt_token_ids)
            rec.output_tokens = len(out.output_token_ids)
            rec.cache = dict(out.cache_stats or {})
            done.append(rec)
            if k + 1 < len(convs[slot].turns):
                think = _turn_rng(seed, slot, k, "think").expovariate(1.0 / think_time_s)
                heapq.heappush(heap, (rec.finished + think, slot, k + 1))
            else:
                sessions -= 1
            if progress:
                progress(len(done), total)
    unfinished = list(records.values())
    done.extend(unfinished)
    return LoadResult(done, duration_s, clock.now() - t0, len(unfinished), samples)
