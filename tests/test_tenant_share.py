"""``tenant_kv_share``: one tenant's extreme retention hints cannot take another tenant's
cached tokens below its share of a tier (two tenants, small tiers, the real scheduler and
cache over a scripted executor)."""

from __future__ import annotations

import pytest
from server_scripted import CHUNK, scripted_engine

from pensieve.core.conversation import Tier
from pensieve.core.sampling_params import SamplingParams

GPU, CPU = 16, 16


def _turn(eng, rid: str, cid: str, n: int) -> None:  # type: ignore[no-untyped-def]
    eng.add_request(rid, [7] * n, SamplingParams(max_tokens=1, ignore_eos=True),
                    conversation_id=cid)
    while eng.has_unfinished():
        eng.step()


def _cached_chunks(eng, cid: str) -> dict[Tier, int]:  # type: ignore[no-untyped-def]
    conv = eng.cache.conversations[cid]
    return {t: sum(ch.tier is t for ch in conv.chunks) for t in (Tier.GPU, Tier.CPU)}


def _run(share: float | None) -> tuple[dict[Tier, int], int]:
    """B's cached chunks per tier after A's hinted turns, and the positions B's next turn
    (8 new tokens) computed."""
    eng, ex = scripted_engine(100, (99,), num_gpu_blocks=GPU, num_cpu_blocks=CPU,
                              tenant_kv_share=share)
    ex.filler = 7
    _turn(eng, "b0", "B", 6 * CHUNK - 1)  # B: 6 chunks, no hints
    eng.set_conversation_hints("B", tenant="B")
    for k in range(12):  # A: many conversations, extreme hints, 4 chunks each
        cid = f"A{k}"
        eng.set_conversation_hints(cid, priority=1e300, keep_alive_s=1e9, tenant="A")
        _turn(eng, f"a{k}", cid, 4 * CHUNK - 1)
    eng.cache.check_integrity()
    cached = _cached_chunks(eng, "B")
    _turn(eng, "b1", "B", 8)
    eng.cache.check_integrity()
    return cached, ex.computed[-1]


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_hints_cannot_push_another_tenant_below_its_share(share: float) -> None:
    unbounded, computed_unbounded = _run(None)
    bounded, computed = _run(share)
    print(f"\nB's cached chunks (gpu, cpu) after A's hinted turns: without a share "
          f"{tuple(unbounded.values())} (next turn computed {computed_unbounded} positions), "
          f"with share {share}: {tuple(bounded.values())} (computed {computed})")
    assert unbounded[Tier.GPU] + unbounded[Tier.CPU] == 0  # the defect, without the share
    assert computed_unbounded >= 6 * CHUNK
    assert bounded[Tier.GPU] + bounded[Tier.CPU] >= min(6, share * GPU)
    assert computed <= 6 * CHUNK + 8 - min(6, int(share * GPU)) * CHUNK + CHUNK


def test_tenant_kv_share_flag() -> None:
    import argparse

    from pensieve.server.main import share_arg, tenant_kv_share

    assert tenant_kv_share(share_arg("auto"), 0) is None
    assert tenant_kv_share(share_arg("auto"), 1) is None
    assert tenant_kv_share(share_arg("auto"), 4) == 0.25
    assert tenant_kv_share(share_arg("0.3"), 1) == 0.3
    assert tenant_kv_share(share_arg("off"), 4) is None
    for bad in ("0", "1.5", "nan", "x", "-0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            share_arg(bad)


def test_share_follows_deletes_and_dropped_hints() -> None:
    eng, ex = scripted_engine(100, (99,), num_gpu_blocks=GPU, num_cpu_blocks=CPU,
                              tenant_kv_share=0.25)
    ex.filler = 7
    share = eng.cache.tenant_share
    for k in range(2):
        eng.set_conversation_hints(f"A{k}", priority=50.0, tenant="A")
        _turn(eng, f"a{k}", f"A{k}", 3 * CHUNK - 1)
    assert share.held["A"][Tier.GPU] == 6 and "A" in share.over  # 6 > 0.25 * 16
    assert eng.cache.conversations["A0"].priority < 1.0  # demoted while over
    eng.set_conversation_hints("A1", priority=1.0, keep_alive_s=0.0)  # no hints: not counted
    assert share.held["A"][Tier.GPU] == 3 and "A" not in share.over
    assert eng.cache.conversations["A0"].priority == 50.0  # its hints count again
    eng.cache.delete("A0")
    assert share.held["A"][Tier.GPU] == 0
    eng.cache.check_integrity()
