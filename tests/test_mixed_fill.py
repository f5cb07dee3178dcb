"""``MixedGraphs.fill`` (vectorized over ranges and tokens) against a range-by-range
reference, for random steps: decodes, prefill turns, requests that recompute leading tokens
beside a new turn, unsampled requests; decodes together or split (ragged or not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.kernels.launch import work_items_for
from pensieve.kernels.launch_policy import use_split_span
from pensieve.runner.mixed_graphs import MIXED_TILES

CHUNK, BLOCKS, MAX_TOKENS, MAX_RANGES, MAX_BLOCKS = 16, 64, 128, 12, 16


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):  # noqa: ANN001, ANN201
    import transformers

    from pensieve.engine.kv_layout import KVLayout
    from pensieve.models.loader import load_model
    from pensieve.runner.mixed_graphs import MixedGraphs

    path = tmp_path_factory.mktemp("fill")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    model, _ = load_model(str(path), dtype=torch.float32, device=torch.device("cpu"))
    kv = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, chunk_size=CHUNK,
                  dtype=torch.float32).allocate(BLOCKS, torch.device("cpu"))
    return {(d, s): MixedGraphs(model, kv, CHUNK, MAX_TOKENS, MAX_RANGES, MAX_BLOCKS,
                                capture=False, decodes=d, span_mode=s)
            for d in ("together", "split") for s in ("auto", "1")}


@st.composite
def steps(draw) -> SchedulerOutput:  # noqa: ANN001
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        ctx = draw(st.integers(1, MAX_BLOCKS * CHUNK - 8))
        size = (ctx + 4) // CHUNK + 1  # room for a new turn after ctx
        table = tuple(draw(st.lists(st.integers(0, BLOCKS - 1), min_size=size, max_size=size)))
        kind = draw(st.sampled_from(["decode", "turn", "recompute"]))
        tok = st.integers(0, 63)
        if kind == "decode":
            ranges = [QueryRange(ctx - 1, [draw(tok)])]
        elif kind == "turn":
            n = draw(st.integers(1, min(ctx, 20)))
            ranges = [QueryRange(ctx - n, draw(st.lists(tok, min_size=n, max_size=n)))]
        else:  # leading tokens recomputed, then a new turn of 1-4 tokens at the end
            lead = draw(st.integers(1, min(ctx, 10)))
            new = draw(st.integers(1, 4))
            ranges = [QueryRange(0, draw(st.lists(tok, min_size=lead, max_size=lead))),
                      QueryRange(ctx, draw(st.lists(tok, min_size=new, max_size=new)))]
        reqs.append(ScheduledRequest(request_id=f"r{i}", block_table=table, ranges=ranges,
                                     sample=draw(st.booleans()),
                                     sampling_params=SamplingParams(temperature=0.0),
                                     num_output_tokens=0))
    return SchedulerOutput(requests=reqs)


def _reference(g, sched: SchedulerOutput, split: bool) -> dict[str, list[int]]:  # noqa: ANN001
    """Range by range, in the order the kernels read them."""
    items, num_dec = sched.ranges_in_order(decodes_first=split)
    out: dict[str, list[int]] = {k: [] for k in ("ids", "pos", "slots", "qsl", "start", "rtab",
                                                 "dqsl", "dstart", "drtab")}
    out["qsl"], out["dqsl"] = [num_dec], [0]
    ends, t = {}, 0
    for n, (i, j, rng) in enumerate(items):
        table = sched.requests[i].block_table
        for k, tok in enumerate(rng.token_ids):
            p = rng.start_pos + k
            out["ids"].append(tok)
            out["pos"].append(p)
            out["slots"].append(table[p // CHUNK] * CHUNK + p % CHUNK)
        t += rng.query_len
        ends[i, j] = t
        pre = "d" if n < num_dec else ""
        out[pre + "start"].append(rng.start_pos)
        out[pre + "rtab"].append(i)
        out[pre + "qsl"].append(t)
    out["rows"] = [ends[i, len(s.ranges) - 1] - 1 for i, s in enumerate(sched.requests)
                   if s.sample]
    qsl = out["qsl"]
    qlens = [b - a for a, b in zip(qsl, qsl[1:])]
    # the items' split span: the KV positions their tiles read over 4 programs a SM (4 SMs
    # off CUDA), at least 256, a multiple of 256
    work = sum(-(-q * g.group // MIXED_TILES[0]) * (s + q) for q, s in zip(qlens, out["start"]))
    out["span"] = -(-max(256, -(-work * g.num_kv_heads // 16)) // 256) * 256
    splits = g._items_splits(g.bucket_for(t))
    out["work"] = work_items_for(qlens, g.group, MIXED_TILES[0], out["start"], splits,
                                 out["span"], MIXED_TILES[1]).tolist()
    return out


@settings(max_examples=150, deadline=None)
@given(sched=steps(), decodes=st.sampled_from(["together", "split"]),
       span=st.sampled_from(["auto", "1"]))
def test_fill_writes_what_a_range_by_range_reference_writes(graphs, sched, decodes: str,
                                                            span: str) -> None:  # noqa: ANN001
    g = graphs[decodes, span]
    if not g.can_run(sched):
        return
    bucket = g.fill(sched)
    dec_lens = sched.decode_kv_lens()
    split = decodes == "split" and bool(dec_lens) and use_split_span(dec_lens, span)
    ref = _reference(g, sched, split)
    t, n, nd = len(ref["ids"]), len(ref["qsl"]) - 1, len(ref["dqsl"]) - 1
    h64, h32 = g._np64, g._np32
    mt, mr = MAX_TOKENS, MAX_RANGES
    assert bucket >= t
    assert h64[:t].tolist() == ref["ids"]
    assert h64[mt : mt + t].tolist() == ref["pos"]
    assert h64[2 * mt : 2 * mt + t].tolist() == ref["slots"]
    assert (h64[2 * mt + t : 2 * mt + bucket] == -1).all()
    assert h64[3 * mt : 3 * mt + len(ref["rows"])].tolist() == ref["rows"]
    assert h32[: n + 1].tolist() == ref["qsl"]
    assert (h32[n + 1 : mr + 1] == t).all()
    assert h32[mr + 1 : mr + 1 + n].tolist() == ref["start"]
    assert h32[2 * mr + 1 : 2 * mr + 1 + n].tolist() == ref["rtab"]
    o = g._dec_at
    assert h32[o : o + nd + 1].tolist() == ref["dqsl"]
    assert h32[o + mr + 1 : o + mr + 1 + nd].tolist() == ref["dstart"]
    assert h32[o + 2 * mr + 1 : o + 2 * mr + 1 + nd].tolist() == ref["drtab"]
    w0 = 3 * mr + 1 + mr * MAX_BLOCKS
    assert h32[w0 : w0 + len(ref["work"])].tolist() == ref["work"]
    assert h32[-1] == len(ref["work"])
    assert g.kv_splits and h32[-2] == ref["span"]
    assert (nd > 0) == split
    assert np.array_equal(g._host32.numpy(), h32)  # the numpy views write the host buffer


def test_mixed_kv_splits_follow_the_bucket_only() -> None:
    """The split grid of a mixed-step graph fills 4 programs a SM (4 SMs off CUDA) for the
    bucket's tiles, at most MAX_SPLITS; the span grows with the KV the step's tiles read."""
    from pensieve.kernels.launch_policy import MAX_SPLITS, mixed_kv_splits, mixed_split_span

    cpu = torch.device("cpu")
    assert mixed_kv_splits(16, 4, 64, 10, cpu) == 2  # 1 tile x 10 heads -> 16 programs wanted
    assert mixed_kv_splits(16, 4, 64, 1, cpu) == 16
    assert mixed_kv_splits(512, 4, 64, 10, cpu) == 1
    assert mixed_kv_splits(1, 1, 64, 1, cpu) == min(16, MAX_SPLITS)
    assert mixed_split_span(np.array([24]), np.array([100]), 4, 64, 10, cpu) == 256
    # 2 tiles x (8,192 + 24) positions x 10 heads / 16 programs = 10,270 -> 10,496
    assert mixed_split_span(np.array([24]), np.array([8192]), 4, 64, 10, cpu) == 10496
    assert mixed_split_span(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4, 64,
                            10, cpu) == 256


