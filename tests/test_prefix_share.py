"""Shared prefixes in the cache (``core.prefix_share``): exact blocks on hand-built cases, and
random workloads with shared prefixes, branches, evictions and tenants under every policy."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.conversation import Tier
from pensieve.core.eviction import get_policy
from pensieve.core.prefix_share import extend_hashes, share_salt
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.tiered_cache import TieredKVCache
from tests.test_tiered_cache import CACHE_OPTIONS, IDS, KINDS, Driver, cost, unshared

C = 4
SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full chunks and a partial one


def make(policy: str = "pensieve", gpu: int = 16, cpu: int = 8, **kw: object) -> TieredKVCache:
    opts = {k: kw.pop(k) for k in list(kw) if k in CACHE_OPTIONS}
    return TieredKVCache(gpu, cpu, cost, unshared(C, swap_out_threshold=0.0, decode_reserve=0.0,
                                                  share_prefixes=True, **opts),
                         policy=get_policy(policy), **kw)  # type: ignore[arg-type]


def run_turn(cache: TieredKVCache, cid: str, ids: list[int], now: float,
             salt: bytes = b"") -> Request:
    """A whole turn of ``cid`` with context ``ids`` (history + new): admit, compute, sample
    token 99, end."""
    conv = cache.conversation(cid)
    req = Request(f"{cid}@{now}", conv.token_ids + ids, SamplingParams(max_tokens=1),
                  conversation_id=cid, share_salt=salt)
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, now)
    req.take(req.num_pending)
    req.append_output(99)
    cache.end_turn(req, conv, now)
    cache.check_integrity()
    return req


def test_second_conversation_takes_the_first_ones_full_chunks() -> None:
    cache = make()
    a = run_turn(cache, "a", SYSTEM + [20, 21], 0.0)
    assert a.cache_stats.shared_hit_tokens == 0
    b = run_turn(cache, "b", SYSTEM + [30, 31, 32], 1.0)
    # positions 0..7 (two full chunks) are A's blocks; 8.. computed by B
    assert b.cache_stats.shared_hit_tokens == 8
    assert b.cache_stats.new_prompt_tokens == len(SYSTEM) + 3 - 8
    ca, cb = cache.conversations["a"].chunks, cache.conversations["b"].chunks
    assert [ch.block for ch in cb[:2]] == [ch.block for ch in ca[:2]]
    assert cb[2].block != ca[2].block  # other tokens: B's own
    share = cache.blocks
    assert share is not None
    assert [share.gpu.refs_of(ch.block) for ch in ca] == [2, 2, 1]
    assert share.gpu.refs_of(cb[2].block) == 1
    assert not share.gpu.refs_of(cb[3].block)  # partial: private
    # A: 3 chunks (12 tokens), B: 4 (13), two of them A's blocks: 5 GPU blocks taken
    assert cache.gpu.num_blocks - cache.gpu.num_free_blocks == 5
    assert share.gpu.num_refs == 6


def test_tenants_do_not_share_unless_salts_agree() -> None:
    cache = make()
    run_turn(cache, "a", SYSTEM + [20], 0.0, salt=share_salt("t1", None, False))
    b = run_turn(cache, "b", SYSTEM + [20], 1.0, salt=share_salt("t2", None, False))
    assert b.cache_stats.shared_hit_tokens == 0
    c = run_turn(cache, "c", SYSTEM + [20], 2.0, salt=share_salt("t1", "x", False))
    assert c.cache_stats.shared_hit_tokens == 0  # a cache_salt of its own
    d = run_turn(cache, "d", SYSTEM + [20], 3.0, salt=share_salt("t1", None, False))
    assert d.cache_stats.shared_hit_tokens == 8
    assert share_salt("t1", None, True) == share_salt("t2", None, True)
    assert share_salt("t1", "x", True) != share_salt("t2", None, True)


def test_evicting_a_shared_chunk_moves_it_to_the_cpu_once() -> None:
    cache = make(cpu=8)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    run_turn(cache, "b", SYSTEM + [30], 1.0)
    share = cpu_share = cache.blocks
    assert share is not None and cpu_share is not None
    shared = cache.conversations["a"].chunks[0].block
    cache.take_swap_plan()
    # evict everything idle: chunks held alone first, then (no candidate left) each shared
    # block, copied once to one CPU block that both sharers hold
    cache.store.evict_gpu(100, 2.0, urgent=True)
    cache.check_integrity()
    a, b = cache.conversations["a"].chunks, cache.conversations["b"].chunks
    assert all(ch.tier is Tier.CPU for ch in a + b)
    for i in range(2):
        assert a[i].block == b[i].block and cpu_share.cpu.refs_of(a[i].block) == 2
    assert a[2].block != b[2].block and not cpu_share.cpu.refs_of(a[2].block)  # partial: private
    assert not share.gpu.refs_of(shared) and share.gpu.num == 0 and cpu_share.cpu.num == 2
    assert cpu_share.cpu.num_refs == 4
    plan = cache.take_swap_plan()  # one copy per CPU block: 2 shared + 2 private chunks
    assert sorted(c for _, c in plan.swap_out_first) == sorted({ch.block for ch in a + b})
    cache.begin_step()
    # A's next turn swaps its chunks in; B still holds the CPU copies of the shared ones
    req = run_turn(cache, "a", [40], 3.0)
    assert req.cache_stats.cpu_hit_tokens == 11 and req.cache_stats.recomputed_tokens == 0
    assert [cpu_share.cpu.refs_of(ch.block) for ch in b[:2]] == [1, 1]
    cache.begin_step()
    cache.check_integrity()
    # a new conversation takes references to them (not registered on the GPU any more)
    assert share.gpu.num  # A's turn registered its GPU blocks again
    run_turn(cache, "a2", [1, 2, 3], 4.0)  # unrelated


def test_cpu_copy_is_shared_at_admission_and_read_before_freed() -> None:
    cache = make(gpu=16, cpu=8)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    run_turn(cache, "b", SYSTEM + [30], 1.0)
    cpu_share = cache.blocks
    assert cpu_share is not None
    cache.store.evict_gpu(100, 2.0, urgent=True)  # everything to the CPU, shared blocks once
    cache.take_swap_plan()
    cache.begin_step()
    copies = [ch.block for ch in cache.conversations["a"].chunks[:2]]
    # C (no KV) takes references to the CPU copies and swaps them in: 8 tokens shared
    c = run_turn(cache, "c", SYSTEM + [50], 3.0)
    assert c.cache_stats.cpu_shared_tokens == 8 and c.cache_stats.cpu_hit_tokens == 8
    assert c.cache_stats.shared_hit_tokens == 0
    assert [cpu_share.cpu.refs_of(b) for b in copies] == [2, 2]  # A and B still hold them
    plan = cache.take_swap_plan()
    assert sorted(cb for cb, _ in plan.swap_in) == sorted(copies)
    # A and B let them go in the same step: the blocks are read, so freed only at the next
    for cid in ("a", "b"):
        cache.delete(cid)
    cache.check_integrity()
    assert all(not cache.cpu.is_free(b) for b in copies) and set(cpu_share.orphans) == set(copies)
    cache.begin_step()
    cache.check_integrity()
    assert all(cache.cpu.is_free(b) for b in copies) and not cpu_share.num_reads


def test_shared_cpu_blocks_go_last_and_with_all_their_holders() -> None:
    """A CPU block several chunks hold is no CPU eviction candidate: the private CPU chunks
    go first; then, with the CPU index empty, the fallback drops one shared block, every
    holder letting it go."""
    cache = make(cpu=8)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    run_turn(cache, "b", SYSTEM + [30], 1.0)
    cache.store.evict_gpu(100, 2.0, urgent=True)
    cache.take_swap_plan()
    cache.begin_step()
    cache.check_integrity()
    cpu_share = cache.blocks
    assert cpu_share is not None and cpu_share.cpu.num == 2
    a, b = cache.conversations["a"].chunks, cache.conversations["b"].chunks
    held = cache.cpu.allocate(cache.cpu.num_free_blocks)  # the tier full
    taken = [cache.store.take_cpu_block(None) for _ in range(3)]
    assert a[2].tier is Tier.DROPPED and b[2].tier is Tier.DROPPED  # private ones first
    gone = [i for i in range(2) if a[i].tier is Tier.DROPPED]
    assert len(gone) == 1 and b[gone[0]].tier is Tier.DROPPED  # both holders let it go
    assert cpu_share.cpu.num == 1 and cpu_share.cpu.num_refs == 2
    cache.cpu.free(held + taken)
    cache.check_integrity()


def test_no_cpu_tier_drops_a_shared_chunk() -> None:
    cache = make(cpu=0)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    run_turn(cache, "b", SYSTEM + [30], 1.0)
    cache.store.evict_gpu(100, 2.0, urgent=True)
    cache.check_integrity()
    a, b = cache.conversations["a"].chunks, cache.conversations["b"].chunks
    assert all(ch.tier is Tier.DROPPED for ch in a + b)
    req = run_turn(cache, "a", [40], 3.0)
    assert req.cache_stats.shared_hit_tokens == 0 and req.cache_stats.recomputed_tokens == 11


def test_running_reader_keeps_a_shared_block() -> None:
    cache = make(gpu=8, cpu=0)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    conv = cache.conversation("b")
    req = Request("b1", SYSTEM + [30], SamplingParams(max_tokens=1), conversation_id="b")
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, 1.0)
    assert req.cache_stats.shared_hit_tokens == 8
    blocks = conv.block_table[:2]
    freed = cache.store.evict_gpu(100, 2.0, urgent=True)  # dropped: no CPU tier
    cache.check_integrity()
    # a's chunks that b reads are no candidates (a reference dropped would free nothing, nor
    # could the block go): only a's own chunk leaves
    a_chunks = cache.conversations["a"].chunks
    assert freed == 1
    assert [ch.tier for ch in a_chunks] == [Tier.GPU, Tier.GPU, Tier.DROPPED]
    assert all(not cache.gpu.is_free(b) for b in blocks)  # b still reads them
    share = cache.blocks
    assert share is not None and [share.gpu.refs_of(b) for b in blocks] == [2, 2]
    # a's next turn finds them on the GPU (b still running)
    req_a = Request("a2", cache.conversations["a"].token_ids + [1],
                    SamplingParams(max_tokens=1), conversation_id="a")
    conv_a = cache.conversations["a"]
    req_a.pending = cache.pending_for(req_a, conv_a)
    assert cache.admit(req_a, conv_a, req_a.num_tokens, 3.0)
    assert req_a.cache_stats.gpu_hit_tokens == 8
    assert req_a.cache_stats.shared_hit_tokens == 0
    assert conv_a.block_table[:2] == blocks
    assert cache.store.pinned_gpu == len(set(conv.block_table) | set(conv_a.block_table))
    cache.check_integrity()


def test_branch_shares_the_history_before_the_edit() -> None:
    cache = make()
    run_turn(cache, "a", SYSTEM + [20, 21, 22, 23, 24, 25], 0.0)
    hist = cache.conversations["a"].token_ids
    b = run_turn(cache, "a-edit", hist[:13] + [77, 78], 1.0)
    assert b.cache_stats.shared_hit_tokens == 12  # three full chunks before the edit


def test_stateless_policy_shares_nothing() -> None:
    cache = make("stateless")
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    b = run_turn(cache, "b", SYSTEM + [20], 1.0)
    assert b.cache_stats.shared_hit_tokens == 0
    assert cache.gpu.num_free_blocks == cache.gpu.num_blocks


class ShareDriver(Driver):
    """The cache driver of ``test_tiered_cache`` with salts per tenant (conversation ``cK``
    belongs to tenant ``K % 2``), branches (a new conversation from another's history), and
    the checks of sharing after every operation."""

    def __init__(self, cache: TieredKVCache, across: bool) -> None:
        super().__init__(cache)
        self.across = across
        self.cpu_refs_seen = 0
        """The most chunks seen holding one CPU block (> 1: the CPU tier shared)."""

    def salt(self, cid: str) -> bytes:
        return share_salt(str(int(cid[1:]) % 2), None, self.across)

    def do(self, kind: str, a: int, b: int, dt: float) -> None:
        cache = self.cache
        if kind == "branch":
            src = [c for c in IDS if cache.conversations.get(c) and
                   cache.conversations[c].token_ids]
            dst = [c for c in IDS if c not in self.running and c not in self.suspended]
            if src and dst:
                s, d = src[a % len(src)], dst[b % len(dst)]
                hist = cache.conversations[s].token_ids
                if s != d:
                    cache.delete(d)
                    conv = cache.conversation(d)
                    conv.token_ids = hist[:1 + a % len(hist)]  # a history without KV
            kind = "admit"
        before = {cid: cache.conversations[cid].block_table for cid in self.running}
        super().do(kind, a, b, dt)
        self.check()
        for cid, table in before.items():  # no pass moved or freed a running turn's block
            conv = cache.conversations.get(cid)
            if conv is not None and conv.running:
                assert conv.block_table[:len(table)] == table, cid
                assert not any(cache.gpu.is_free(b) for b in conv.block_table), cid

    def check(self) -> None:
        cache = self.cache
        share = cache.blocks
        assert share is not None
        cpu_share = cache.blocks if cache.cpu is not None else None
        cpu_refs = [cpu_share.cpu.refs_of(b) for b in range(len(cpu_share.cpu.at))] \
            if cpu_share is not None else []
        salts: dict[tuple[Tier, int], set[bytes]] = {}
        for conv in cache.conversations.values():
            for ch in conv.chunks:
                if (ch.tier is Tier.GPU and share.gpu.refs_of(ch.block)) or (
                        ch.tier is Tier.CPU and cpu_refs[ch.block]):
                    salts.setdefault((ch.tier, ch.block), set()).add(
                        self.salt(conv.conversation_id))
        if not self.across:
            assert all(len(s) == 1 for s in salts.values()), "tenants share a block"
        for conv in cache.conversations.values():  # a registered block holds its tokens
            if conv.running:
                continue
            n = min(conv.kv_end, len(conv.token_ids)) // C
            hashes: list[bytes] = []
            extend_hashes(hashes, self.salt(conv.conversation_id), conv.token_ids[:n * C], C)
            for i in range(n):
                ch = conv.chunks[i]
                if ch.tier is Tier.GPU and share.gpu.refs_of(ch.block):
                    assert share.hash_of[share.gpu.at[ch.block]] == hashes[i], (
                        conv.conversation_id, i)
                if ch.tier is Tier.CPU and cpu_share is not None and cpu_refs[ch.block]:
                    assert cpu_share.hash_of[cpu_share.cpu.at[ch.block]] == hashes[i], (
                        conv.conversation_id, i)
        for conv in cache.conversations.values():  # the admission's count of pinned blocks
            if not conv.running:
                tiers = [ch.tier for ch in conv.chunks]
                pinned = share.gpu.is_pinned
                assert share.pinned_by_others(conv.chunks, tiers, [], []) == sum(
                    1 for ch in conv.chunks if ch.tier is Tier.GPU and pinned(ch.block))
        # background copies out read their GPU block until reclaimed (an urgent one's block
        # is free at once: the runner copies it before the step touches any KV)
        leaving = set(cache.store._plan.swap_out.values())
        leaving |= {g for grp in cache.store._reclaim_groups for g in grp}
        for cid in self.running:
            table = cache.conversations[cid].block_table
            assert not leaving & set(table), "a block a running turn reads is leaving"
        # a CPU block a planned swap-in reads is not free (so no copy out can take it)
        plan = cache.store._plan
        for cb, _ in plan.swap_in + plan.swap_in_ahead:
            assert cache.cpu is not None and not cache.cpu.is_free(cb), cb
        for reads in (plan.swap_in, plan.swap_in_ahead):  # the runner's batches need this
            assert len({cb for cb, _ in reads}) == len(reads), "a CPU block read twice"
        if cpu_share is not None:
            self.cpu_refs_seen = max(self.cpu_refs_seen, max(cpu_refs, default=0))


@pytest.fixture(autouse=True)
def _salted_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests the driver builds carry their tenant's salt (set from the conversation id)."""
    orig = Request.__post_init__

    def post_init(self: Request) -> None:
        orig(self)
        cid = self.conversation_id
        if cid is not None and not self.share_salt and _ACROSS is not None:
            self.share_salt = share_salt(str(int(cid[1:]) % 2), None, _ACROSS[0])

    monkeypatch.setattr(Request, "__post_init__", post_init)


_ACROSS: list[bool] | None = None


@settings(max_examples=400, deadline=None, derandomize=True)
@given(policy=st.sampled_from(["pensieve", "lru", "prefix-lru", "gpu-only", "return"]),
       seed=st.integers(0, 2**32), n_ops=st.integers(1, 150),
       gpu=st.integers(6, 20), cpu=st.integers(0, 8), across=st.booleans(),
       swap_chunk_s=st.sampled_from([None, 0.0, 1.5]),
       threshold=st.sampled_from([0.0, 0.25]), defer=st.sampled_from([0, 1]))
def test_random_workloads_keep_references_exact(
        policy: str, seed: int, n_ops: int, gpu: int, cpu: int, across: bool,
        swap_chunk_s: float | None, threshold: float, defer: int) -> None:
    """Random admit / grow / end / suspend / abort / delete / branch / steps over a few token
    values (so full chunks repeat across conversations): after every operation the reference
    counts equal the chunks holding each block and the pins the running conversations
    (``check_integrity``), no block a running turn reads is being copied out or reclaimed,
    and no block is shared by two tenants unless ``across``."""
    global _ACROSS
    _ACROSS = [across]
    try:
        cache = TieredKVCache(gpu, cpu, cost,
                              unshared(C, swap_out_threshold=threshold, decode_reserve=0.0,
                                       defer_admission=defer, share_prefixes=True,
                                       share_prefixes_across_tenants=across),
                              policy=get_policy(policy), swap_chunk_s=swap_chunk_s)
        rng = random.Random(seed)
        d = ShareDriver(cache, across)
        kinds = KINDS + ["branch", "branch"]
        for _ in range(n_ops):
            d.do(rng.choice(kinds), rng.randint(0, 50), rng.randint(0, 50),
                 rng.choice([0.0, 0.0, 0.05, 0.4, 3.0]))
    finally:
        _ACROSS = None


def test_random_workloads_do_share() -> None:
    """The property test's workload does exercise sharing (a guard against a vacuous pass)."""
    hits = sum(_guard_workload("pensieve", 12, seed).stats.shared_hit_tokens
               for seed in range(20))
    assert hits > 0


def test_random_workloads_share_in_the_cpu_tier() -> None:
    """With a small GPU tier the workload shares CPU blocks too: chunks holding one CPU block
    together, and admissions taking references to CPU copies (a guard against a vacuous
    pass of the property test there)."""
    caches = [_guard_workload("pensieve", 7, seed, cpu=8) for seed in range(20)]
    assert sum(c.stats.cpu_shared_tokens for c in caches) > 0
    assert max(c.cpu_refs_seen for c in caches) > 1  # type: ignore[attr-defined]


def _guard_workload(policy: str, gpu: int, seed: int, cpu: int = 4) -> TieredKVCache:
    """120 random operations of the property test's driver (one tenant per parity, not
    shared across), ``cpu`` CPU blocks: the cache after them (with ``cpu_refs_seen``)."""
    global _ACROSS
    _ACROSS = [False]
    try:
        cache = TieredKVCache(gpu, cpu, cost, unshared(C, swap_out_threshold=0.25,
                                                       decode_reserve=0.0, share_prefixes=True),
                              policy=get_policy(policy))
        rng = random.Random(seed)
        d = ShareDriver(cache, False)
        for _ in range(120):
            d.do(rng.choice(KINDS + ["branch", "branch"]), rng.randint(0, 50),
                 rng.randint(0, 50), rng.choice([0.0, 0.05, 0.4, 3.0]))
        cache.cpu_refs_seen = d.cpu_refs_seen  # type: ignore[attr-defined]
        return cache
    finally:
        _ACROSS = None


def test_rewritten_history_is_hashed_again() -> None:
    """A conversation whose history was rewritten without KV (the server's ``set_history``)
    must not reuse its old hashes: its new tokens share only with their own equals."""
    cache = make()
    run_turn(cache, "a", SYSTEM + [20, 21, 22, 23, 24, 25], 0.0)
    run_turn(cache, "b", [50] * 12, 1.0)
    conv = cache.conversations["a"]
    cache.store.free_chunks(conv, 0)  # the KV goes, as truncate_history's abort does
    cache.index.reindex(conv)
    conv.token_ids = [50] * 9  # the history is rewritten
    req = run_turn(cache, "a", [7], 2.0)
    assert req.cache_stats.shared_hit_tokens == 8  # b's two chunks of 50s, not a's old ones
    assert [ch.block for ch in conv.chunks[:2]] == \
        [ch.block for ch in cache.conversations["b"].chunks[:2]]


def test_turns_that_computed_one_prefix_together_end_up_sharing_it() -> None:
    """Two first turns with the same system prompt admitted together both compute it; when
    each ends, the second's equal chunks take the first's blocks and free their own."""
    cache = make()
    reqs = []
    for cid, q in (("a", [20]), ("b", [30])):
        conv = cache.conversation(cid)
        req = Request(cid, SYSTEM + q, SamplingParams(max_tokens=1), conversation_id=cid)
        req.pending = cache.pending_for(req, conv)
        assert cache.admit(req, conv, req.num_tokens, 0.0)
        assert req.cache_stats.shared_hit_tokens == 0
        reqs.append((req, conv))
    assert cache.gpu.num_blocks - cache.gpu.num_free_blocks == 6
    for req, conv in reqs:
        req.take(req.num_pending)
        req.append_output(99)
        cache.end_turn(req, conv, 1.0)
        cache.check_integrity()
    a, b = cache.conversations["a"].chunks, cache.conversations["b"].chunks
    assert [ch.block for ch in a[:2]] == [ch.block for ch in b[:2]]
    assert cache.gpu.num_blocks - cache.gpu.num_free_blocks == 4


def test_chunks_brought_back_are_registered_again() -> None:
    """A prefix whose blocks all left the GPU is shareable again once a turn of its holder
    swaps it back in (or recomputes it) and ends."""
    cache = make(cpu=8)
    run_turn(cache, "a", SYSTEM + [20], 0.0)
    cache.store.evict_gpu(100, 1.0, urgent=True)
    cache.take_swap_plan()
    cache.begin_step()
    share = cache.blocks
    assert share is not None and share.gpu.num == 0
    back = run_turn(cache, "a", [21], 2.0)
    assert back.cache_stats.cpu_hit_tokens > 0
    c = run_turn(cache, "c", SYSTEM + [30], 3.0)
    assert c.cache_stats.shared_hit_tokens == 8


def test_rewritten_history_registers_its_own_hashes() -> None:
    """A history rewritten past its KV (``set_history``: truncate, then new tokens) and a
    turn that finds nothing to share: the chunks it registers carry the new tokens' hashes,
    so a conversation with the old tokens does not take them."""
    cache = make("pensieve", gpu=32, cpu=0)
    old = [40 + k for k in range(16)]
    run_turn(cache, "a", old, 0.0)
    conv = cache.conversations["a"]
    conv.token_ids = conv.token_ids[:4]  # truncate_history: keep one chunk
    cache.abort_turn(Request("x", [0], SamplingParams()), conv, 1.0)
    cache.store.evict_gpu(100, 1.0, urgent=True)  # nothing registered: find_shared returns
    share = cache.blocks
    assert share is not None and share.gpu.num == 0
    conv.token_ids = old[:4] + [7] * 12  # set_history
    run_turn(cache, "a", [8], 2.0)
    other = run_turn(cache, "b", old + [9], 3.0)
    assert other.cache_stats.shared_hit_tokens == 4  # chunk 0 only: 40..43


def test_truncation_into_a_shared_chunk_lets_it_go() -> None:
    """An aborted turn leaves its conversation's KV up to the history's end: a shared chunk
    cut to a partial one would be written by the next turn, so it drops its reference (and
    is recomputed); a block only it held becomes private instead."""
    cache = make()
    run_turn(cache, "a", [1] * 8, 0.0)
    share = cache.blocks
    assert share is not None
    a0 = cache.conversations["a"].chunks[0].block
    conv = cache.conversation("b")
    conv.token_ids = [1]  # a restored history without KV
    req = Request("b1", [1] * 9, SamplingParams(max_tokens=1), conversation_id="b")
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, 1.0)
    assert conv.block_table[0] == a0 and share.gpu.refs_of(a0) == 2
    cache.abort_turn(req, conv, 2.0)
    cache.check_integrity()
    assert conv.kv_end == 1 and conv.chunks[0].tier is Tier.DROPPED and share.gpu.refs_of(a0) == 1
    run_turn(cache, "b", [6] * 7, 3.0)
    assert conv.chunks[0].block != a0
    # a's turn continues on its own block, still registered under its tokens
    assert run_turn(cache, "c", [1] * 9, 4.0).cache_stats.shared_hit_tokens == 8


def test_random_workloads_free_shared_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random workloads free shared blocks whole through the retention order
    (``SharedOrder``), so the property test checks the reference counts across it (a guard
    against a vacuous pass). The fallback (``lowest_shared``: blocks whose sharers left) is
    driven in ``test_shared_eviction``."""
    from pensieve.core.shared_eviction import SharedOrder

    taken: list[int] = []
    orig_take = SharedOrder.take

    def take(self: SharedOrder) -> Any:
        taken.append(1)
        return orig_take(self)

    monkeypatch.setattr(SharedOrder, "take", take)
    for policy in ["pensieve", "prefix-lru"]:
        for seed in range(15):
            _guard_workload(policy, 10, seed)
    assert len(taken) > 0


def test_chunk_hashes_are_chained_blake2b_of_the_token_bytes() -> None:
    """Chunk ``i``'s hash is BLAKE2b-128 of chunk ``i - 1``'s hash (the salt for the first)
    and its tokens as 8-byte little-endian ints; a partial rest is not hashed, and extending
    a list continues its chain."""
    salt = share_salt("t", None, False)
    tokens = [3, 70000, 2**40, 5] * 5  # 20 tokens: two full chunks of 8, 4 left over
    want, prev = [], salt
    for lo in (0, 8):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[lo:lo + 8])
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        want.append(prev)
    got: list[bytes] = []
    extend_hashes(got, salt, tokens, 8)
    assert got == want
    part: list[bytes] = []
    extend_hashes(part, salt, tokens[:8], 8)
    extend_hashes(part, salt, tokens[8:], 8)
    assert part == want
    extend_hashes(part, salt, [1] * 7, 8)  # less than a chunk: nothing to add
    assert part == want
