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

Warm start (:class:`WarmStart`): a cold run starts with no session in flight, and with
conversations of many turns the number in flight takes as long as the longest sessions live to
level off (~1,000 s for ShareGPT at 6 s of think time). With a warm start the run begins where
a steady state would be: the Poisson arrivals also cover ``horizon_s`` before time 0, each past
session is played forward on an assumed latency per answer token (no engine involved) with its
own think times, and those still under way at time 0 are in flight from the start. A session
that was thinking sends its next turn when its think time ends; one that was waiting for an
answer sends that turn again at a time drawn uniformly over what was left of it. Either way
its first request carries its whole history so far (the earlier turns' prompts and answers as
token ids drawn like any prompt) as new input, so the engine holds no state of it yet: what
warms up is the sessions in flight, not the engine's caches, which fill within a few turns.

Shared prefix: with ``shared_prefix_tokens`` = S, every session's first turn opens with the
same S token ids (one generator for the whole run, seeded by ``seed``), before its own input:
a system prompt and tool schema that all sessions send, which a cache that shares prefixes
holds once. The first turn's input grows by S (``input_len`` counts it).

Clairvoyance (for the simulator's ``oracle`` eviction order): given a ``next_think_s`` dict,
the generator writes into it, as the engine accepts each turn, the think time that will follow
that turn's answer (None: the conversation has no next turn; also written when a turn fails),
keyed by the conversation id the engine sees. The next turn is sent at the answer's finish
time plus that think time, so a cache told the map knows when each idle conversation returns.

Steady state: every ``sample_interval_s`` (1 s by default) the generator records a sample of
the run (:attr:`LoadResult.samples`): sessions in flight (arrived, last turn not yet answered),
requests in flight (sent, not yet answered), running totals of sessions, requests sent and
finished, and the engine's state from :func:`~pensieve.bench.engine_api.engine_probe` (KV
blocks used per tier, requests running and waiting, swap and drop totals).
:func:`pensieve.bench.run_metrics.steady_state` compares the window's two halves.
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


@dataclass(frozen=True)
class WarmStart:
    """How :func:`run_load` plays the sessions that arrived before time 0 forward (module doc).

    Each past turn takes ``ttft_s`` plus ``s_per_output_token`` per answer token: the system's
    latency near the load measured (a normalized latency of ~50 ms/token is a 13B model near its
    capacity on one H200). Too low a guess leaves fewer sessions in flight at time 0 than the
    system's steady state holds, and a shorter ramp remains.
    """

    s_per_output_token: float = 0.05
    ttft_s: float = 0.2
    horizon_s: float = 7200.0
    """How far back arrivals go: longer than nearly every session lives."""

    def __post_init__(self) -> None:
        if self.s_per_output_token < 0 or self.ttft_s < 0 or self.horizon_s <= 0:
            raise ValueError(f"invalid warm start {self}")


def add_warm_start_arg(parser: Any) -> None:
    """A benchmark's ``--warm-start [S_PER_TOKEN]`` option (an ``argparse`` parser): absent,
    a cold start; bare, :class:`WarmStart`'s default latency. :func:`warm_start_from` turns its
    value into a :class:`WarmStart`."""
    default = WarmStart.s_per_output_token
    parser.add_argument(
        "--warm-start", type=float, nargs="?", const=default, default=None,
        metavar="S_PER_TOKEN",
        help="begin at a steady state: the sessions that arrived before time 0 and would still "
             "be under way are in flight from the start, played forward at this latency per "
             f"answer token (s; default {default:g})")


def warm_start_from(s_per_output_token: float | None) -> WarmStart | None:
    return None if s_per_output_token is None else WarmStart(s_per_output_token)


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


class _Run:
    """The state of one :func:`run_load`: the turns waiting to be sent, those in flight, the
    finished ones and the counts the samples report."""

    def __init__(self, engine: BenchEngine, convs: list[Conversation], seed: int,
                 vocab_size: int, think_time_s: float, t0: float,
                 next_think_s: dict[str, float | None] | None = None,
                 shared_prefix_tokens: int = 0) -> None:
        self.engine, self.convs, self.seed = engine, convs, seed
        rng = random.Random(f"{seed}:shared-prefix")
        self.shared = [rng.randrange(vocab_size) for _ in range(shared_prefix_tokens)]
        self.next_think_s = next_think_s
        self.vocab_size, self.think_time_s, self.t0 = vocab_size, think_time_s, t0
        self.heap: list[tuple[float, int, int]] = []  # (send time, conversation slot, turn)
        self.records: dict[str, RequestRecord] = {}
        self.done: list[RequestRecord] = []
        self.in_flight = 0
        self.sessions = 0  # arrived, last turn not answered yet
        self.started = self.sent_n = self.finished_n = 0
        self.samples: list[dict[str, float]] = []
        self.warm: set[int] = set()  # warm-started sessions whose first request is still due

    def think(self, slot: int, turn: int) -> float:
        """The think time after ``turn`` of the conversation in ``slot``."""
        return _turn_rng(self.seed, slot, turn, "think").expovariate(1.0 / self.think_time_s)

    def _ids(self, slot: int, turn: int, what: str, n: int) -> list[int]:
        """``n`` token ids of one turn's prompt or (made-up) answer, from its own generator."""
        rng = _turn_rng(self.seed, slot, turn, what)
        return [rng.randrange(self.vocab_size) for _ in range(n)]

    def prompt(self, slot: int, turn: int, with_history: bool) -> list[int]:
        """The new input of ``turn``; ``with_history`` (a warm-started session's first
        request): after its earlier turns' prompts and answers."""
        turns = self.convs[slot].turns
        ids: list[int] = list(self.shared) if turn == 0 or with_history else []
        for j in range(turn if with_history else 0):
            ids += self._ids(slot, j, "prompt", turns[j].input_len)
            ids += self._ids(slot, j, "answer", turns[j].output_len)
        return ids + self._ids(slot, turn, "prompt", turns[turn].input_len)

    def warm_start(self, past: list[tuple[int, float]], warm: WarmStart,
                   rng: random.Random) -> None:
        """Put the sessions of ``past`` ((slot, arrival < 0)) still under way at time 0 in
        flight (module doc)."""
        for slot, t in past:
            turns = self.convs[slot].turns
            for k, turn in enumerate(turns):
                if t >= 0:  # thinking at time 0: its turn k goes out when the think ends
                    send = t
                    break
                done = t + warm.ttft_s + warm.s_per_output_token * turn.output_len
                if done > 0:  # waiting for an answer at time 0: sent again in what was left
                    send = rng.uniform(0.0, done)
                    break
                t = done + self.think(slot, k)
            else:
                continue  # the session ended before time 0
            heapq.heappush(self.heap, (send, slot, k))
            self.warm.add(slot)
        self.sessions = self.started = len(self.warm)

    def send_due(self, now: float) -> None:
        """Send every turn whose time has come."""
        heap, convs = self.heap, self.convs
        while heap and heap[0][0] <= now:
            sent, slot, k = heapq.heappop(heap)
            turn = convs[slot].turns[k]
            rid = f"c{slot}-t{k}"
            warm = slot in self.warm
            self.warm.discard(slot)
            new_session = k == 0 and not warm
            ids = self.prompt(slot, k, with_history=warm)
            params = SamplingParams(max_tokens=turn.output_len, temperature=0.0,
                                    ignore_eos=True)
            self.records[rid] = RequestRecord(f"c{slot}", k, rid, sent, len(ids),
                                              turn.output_len)
            self.in_flight += 1
            self.sent_n += 1
            if new_session:
                self.sessions += 1
                self.started += 1
            try:
                self.engine.add_request(rid, ids, params, arrival_time=self.t0 + sent,
                                        conversation_id=self.conversation_id(slot))
            except ValueError:  # refused (a context past max_model_len: a server's 400)
                self._fail(self._end(rid))
                continue
            if k + 1 < len(convs[slot].turns):
                self._tell(slot, self.think(slot, k))
            else:
                self._tell(slot, None)

    def conversation_id(self, slot: int) -> str:
        """The id the engine knows the conversation in ``slot`` by."""
        return f"{self.convs[slot].conv_id}#{slot}"

    def _tell(self, slot: int, think: float | None) -> None:
        """Record the think time after the current turn of the conversation in ``slot``
        (None: no next turn)."""
        if self.next_think_s is not None:
            self.next_think_s[self.conversation_id(slot)] = think

    def _end(self, rid: str) -> RequestRecord:
        """The record of a request that is no longer in flight."""
        self.in_flight -= 1
        self.finished_n += 1
        return self.records.pop(rid)

    def _fail(self, rec: RequestRecord) -> None:
        """The request failed: it counts as never finished and its conversation stops."""
        rec.error = True
        self.done.append(rec)
        self.sessions -= 1
        self._tell(int(rec.conversation[1:]), None)

    def finish(self, out: Any, clock: Clock) -> None:
        """A turn's answer ``out`` (a request output) arrived; schedule the next turn."""
        rec = self._end(out.request_id)
        slot, k = int(rec.conversation[1:]), rec.turn
        if out.finish_reason == "error":
            self._fail(rec)
            return
        t0 = self.t0
        rec.finished = (out.finish_time or clock.now()) - t0
        rec.first_token = (out.first_token_time - t0) if out.first_token_time else None
        rec.context_len = len(out.prompt_token_ids)
        rec.output_tokens = len(out.output_token_ids)
        rec.cache = dict(out.cache_stats or {})
        self.done.append(rec)
        if k + 1 < len(self.convs[slot].turns):
            heapq.heappush(self.heap, (rec.finished + self.think(slot, k), slot, k + 1))
        else:
            self.sessions -= 1

    def sample(self, now: float) -> None:
        s: dict[str, float] = {"t": round(now, 3), "sessions_in_flight": self.sessions,
                               "requests_in_flight": self.in_flight,
                               "sessions_started": self.started, "requests_sent": self.sent_n,
                               "requests_finished": self.finished_n}
        s.update(engine_probe(self.engine))
        self.samples.append(s)


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
    warm_start: WarmStart | None = None,
    next_think_s: dict[str, float | None] | None = None,
    shared_prefix_tokens: int = 0,
) -> LoadResult:
    """Drive ``engine`` with conversations drawn in order (cycling) from ``conversations``.

    Arrivals stop at ``duration_s``; turns already under way continue until ``drain_s`` after
    that (default: ``duration_s``), then whatever is left is counted as unfinished. Samples
    of the run's state are taken every ``sample_interval_s`` (None: none). ``warm_start``:
    begin with the sessions a steady state would have in flight (module doc).
    ``next_think_s``: filled with the think time after each accepted turn (module doc).
    ``shared_prefix_tokens``: the prefix every session's first turn opens with (module doc).
    """
    rng = random.Random(seed)
    t0 = clock.now()
    back = warm_start.horizon_s if warm_start else 0.0
    arrivals = [t - back for t in arrival_times(conv_rate, duration_s + back, rng)]
    drain = duration_s if drain_s is None else drain_s
    stop_at = duration_s + drain
    convs = [conversations[i % len(conversations)] for i in range(len(arrivals))]
    run = _Run(engine, convs, seed, vocab_size, think_time_s, t0, next_think_s,
               shared_prefix_tokens)
    past = [(slot, t) for slot, t in enumerate(arrivals) if t < 0]
    if warm_start:
        run.warm_start(past, warm_start, random.Random(f"{seed}:warm"))
    for slot, t in enumerate(arrivals[len(past):], start=len(past)):
        heapq.heappush(run.heap, (t, slot, 0))
    total = sum(len(convs[slot].turns) - k for _, slot, k in run.heap)
    next_sample = 0.0 if sample_interval_s else math.inf
    while True:
        # the clock's reading minus t0 may fall a rounding error short of the time slept to
        now = clock.now() - t0 + _EPS
        if now >= stop_at:
            break
        run.send_due(now)
        if now >= next_sample:  # after the sends that were due
            run.sample(now)
            assert sample_interval_s
            while next_sample <= now:
                next_sample += sample_interval_s
        if run.in_flight == 0:
            if not run.heap:
                break
            clock.sleep_until(t0 + min(run.heap[0][0], stop_at, next_sample))
            continue
        for out in engine.step():
            run.finish(out, clock)
            if progress and out.finish_reason != "error":
                progress(len(run.done), total)
    unfinished = list(run.records.values())
    run.done.extend(unfinished)
    return LoadResult(run.done, duration_s, clock.now() - t0, len(unfinished), run.samples)
