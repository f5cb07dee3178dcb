"""A hypothesis state machine over the KV store (the tiered cache, its shared prefixes and its
disk index), on the fake executor and fake disk of ``test_disk_index``, whose slots carry,
for every position, a tag of the tokens (and salt) its KV was computed from.

Operations: turns (admit, grow, end; suspensions come with the pressure of three tiers of
24 GPU, 6 CPU and up to 200 disk chunks), a turn aborted while it runs, a step that fails on
one request (containment aborts it), a branch (a new conversation re-sending another's
history), delete, restart, a corrupt file and an edited history; conversations of two tenants,
prefixes shared within a tenant and, with the flag, across tenants.

After every operation:
- attention only ever read KV of the request's own tokens and salt (the fake executor
  asserts it on every position of every step: no block a running turn reads was moved,
  freed or overwritten under it, and no tenant read another's KV unless the flag shares it);
- every block is where the store says: each idle chunk on the GPU or the CPU holds exactly
  the tags of its conversation's tokens, and the disk's files are the index's entries;
- the cache's own audit (``check_integrity``: every block accounted once, pinned and shared
  reference counts equal a recount), and the disk index's.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_disk_index import SYSTEM, FakeExecutor, World, tag

from pensieve.core.conversation import Tier
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams

C = 4


class FailingExecutor(FakeExecutor):
    """The fake executor, failing a step that holds the request named in :attr:`fail` after
    its copies were made (as the runner does: copies first, whatever the compute does); with
    :attr:`garble`, the copies into that request's blocks leave other bytes (a failed copy)."""

    fail: str | None = None
    garble = False

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        bad = [s for s in sched.requests if s.request_id == self.fail]
        if bad:
            super().execute(SchedulerOutput(requests=[], swaps=sched.swaps))
            if self.garble:
                copied = {g for _, g in sched.swaps.swap_in}
                for b in bad[0].block_table:
                    if b in copied:
                        self.gpu[b] = ["garbage"] * C
            raise RuntimeError(f"step failed on {self.fail}")
        return super().execute(sched)


class StoreMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([0, 12, 200]), across=st.booleans())
    def start(self, capacity: int, across: bool) -> None:
        self.world = World(capacity, across)
        self._use_failing_executor()
        self.lengths: dict[str, int] = {}
        self.n = 0
        self.failed = 0

    def _use_failing_executor(self) -> None:
        w = self.world
        ex = FailingExecutor(lambda: w.eng)
        ex.gpu, ex.cpu = w.ex.gpu, w.ex.cpu  # the same slots
        w.ex = ex
        w.eng.executor = ex

    def _add(self, cid: str, ids: list[int], m: int, tenant: str) -> str | None:
        if self.lengths.get(cid, 0) + len(ids) + m > 72:
            return None
        self.lengths[cid] = self.lengths.get(cid, 0) + len(ids) + m
        self.world.histories.setdefault(cid, [])
        self.n += 1
        rid = f"{cid}#{self.n}"
        self.world.eng.add_request(rid, ids, SamplingParams(max_tokens=m, ignore_eos=True),
                                   conversation_id=cid, tenant=tenant)
        return rid

    def _turns(self, seed: int, k: int) -> list[str]:
        rng = random.Random(seed)
        rids = []
        for c in rng.sample(range(6), k):
            cid = f"c{c}"
            head = SYSTEM[:rng.choice([0, 9, 12])] if cid not in self.lengths else []
            ids = head + [rng.randrange(3, 60) for _ in range(rng.randint(1, 14))]
            rid = self._add(cid, ids, rng.randint(1, 5), f"t{c % 2}")
            if rid is not None:
                rids.append(rid)
        return rids

    def _run_all(self) -> None:
        before = self.world.eng.failed_requests
        w = self.world
        while w.eng.has_unfinished():
            w.clock += 1.0
            w.eng.step()
            self._check()
        self.failed += w.eng.failed_requests - before
        w.ex.fail = None
        for cid in list(w.histories):
            w.histories[cid] = w.eng.conversation_history(cid)
            self.lengths[cid] = len(w.histories[cid])

    def _check(self) -> None:
        w = self.world
        if w.ex.fail is None:  # only the step told to fail fails anyone
            assert w.eng.failed_requests == self.failed
        w.disk.index.check()
        assert set(w.disk.index.files) == set(w.files)

    # ------------------------------------------------------------------ operations
    @rule(seed=st.integers(0, 10**6), k=st.integers(1, 5))
    def turns(self, seed: int, k: int) -> None:
        self._turns(seed, k)
        self._run_all()

    @rule(seed=st.integers(0, 10**6), steps=st.integers(0, 4))
    def abort_while_running(self, seed: int, steps: int) -> None:
        rids = self._turns(seed, 3)
        w = self.world
        for _ in range(steps):
            if w.eng.has_unfinished():
                w.clock += 1.0
                w.eng.step()
        for rid in rids[:1]:
            w.eng.abort_request(rid)
        self._run_all()

    @rule(seed=st.integers(0, 10**6), garble=st.booleans())
    def step_fails_on_one(self, seed: int, garble: bool) -> None:
        rids = self._turns(seed, 3)
        if not rids:
            return
        w = self.world
        w.ex.fail = random.Random(seed).choice(rids)
        w.ex.garble = garble
        while w.eng.has_unfinished():
            w.clock += 1.0
            w.eng.step()
            self._check()
        assert w.eng.failed_requests <= self.failed + 1
        self.failed = w.eng.failed_requests
        w.ex.fail = None
        for cid in list(w.histories):
            w.histories[cid] = w.eng.conversation_history(cid)
            self.lengths[cid] = len(w.histories[cid])

    @precondition(lambda self: any(self.world.histories.values()))
    @rule(seed=st.integers(0, 10**6))
    def branch(self, seed: int) -> None:
        """A new conversation that re-sends another's history with a new question (its
        leading full chunks may come from the other's blocks, as shared prefixes)."""
        rng = random.Random(seed)
        w = self.world
        src = rng.choice(sorted(c for c, h in w.histories.items() if h))
        cid = f"b{self.n}"
        tenant = f"t{int(src[1:]) % 2}" if src.startswith("c") else "t0"
        if self._add(cid, list(w.histories[src]) + [rng.randrange(3, 60)], 2, tenant):
            self._run_all()

    @precondition(lambda self: self.world.histories)
    @rule(seed=st.integers(0, 10**6))
    def delete(self, seed: int) -> None:
        w = self.world
        cid = random.Random(seed).choice(sorted(w.histories))
        w.eng.delete_conversation(cid)
        del w.histories[cid]
        self.lengths.pop(cid, None)
        w.disk.apply()

    @rule()
    def restart(self) -> None:
        self.world.restart()
        self._use_failing_executor()
        self.failed = 0

    @precondition(lambda self: self.world.files)
    @rule(seed=st.integers(0, 10**6))
    def corrupt_a_file(self, seed: int) -> None:
        self.world.corrupt.add(random.Random(seed).choice(sorted(self.world.files)))

    # ------------------------------------------------------------------ audits
    @invariant()
    def every_block_is_where_the_store_says(self) -> None:
        if not hasattr(self, "world"):
            return
        w = self.world
        cache, ex = w.eng.cache, w.ex
        cache.check_integrity()
        for cid, conv in cache.conversations.items():
            if conv.running:
                continue
            salt = w.disk.index.salts.get(cid)
            tokens = conv.token_ids
            for i, ch in enumerate(conv.chunks):
                if ch.tier not in (Tier.GPU, Tier.CPU) or salt is None:
                    continue
                slots = (ex.gpu if ch.tier is Tier.GPU else ex.cpu)[ch.block]
                for p in range(i * C, min((i + 1) * C, conv.kv_end)):
                    assert slots[p % C] == tag(tokens, p, salt), (cid, i, ch, p)

    @invariant()
    def tenants_share_only_with_the_flag(self) -> None:
        if not hasattr(self, "world"):
            return
        index = self.world.disk.index
        if self.world.across_tenants:
            return
        for e in index.files.values():
            assert len({index.salts.get(c) for c in e.holders}) <= 1, e


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=15,
                                          deadline=None, derandomize=True)
test_store_machine = StoreMachine.TestCase
