"""A mixed-step graph's forward with KV splits, end to end on the CPU.

``MixedGraphs.fill`` writes the step's split span and split work items, and the graph's
forward (not captured: the same code a capture records) runs the Triton kernels (through the
interpreter without CUDA). Its logits must equal those of the same forward on the pure-torch
attention, which ignores work items and splits. Turns after long histories are split; a decode,
a new prompt and a short turn ride along, with the decodes together or in their own launch.
"""

import random

import numpy as np
import pytest
import torch
import transformers

import pensieve.kernels as kernels
from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.kernels.launch import work_items_for
from pensieve.runner.mixed_graphs import MIXED_TILES, MixedGraphs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHUNK, BLOCKS, MAX_BLOCKS = 16, 256, 80


@pytest.fixture(scope="module")
def model_and_cache(tmp_path_factory):  # noqa: ANN001, ANN201
    from pensieve.engine.kv_layout import KVLayout
    from pensieve.models.loader import load_model

    path = tmp_path_factory.mktemp("splits")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=1, max_position_embeddings=2048,
                                   initializer_range=0.2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    model, _ = load_model(str(path), dtype=torch.float32, device=DEVICE)
    kv = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, chunk_size=CHUNK,
                  dtype=torch.float32).allocate(BLOCKS, DEVICE)
    kv[0].normal_()  # the histories' K and V
    return model, kv


def _step(rng: random.Random) -> SchedulerOutput:
    """A turn of 6 tokens after 900 cached ones, a decode at 700, a new prompt of 20 tokens,
    a turn of 10 after 300; distinct, shuffled blocks."""
    blocks = list(range(BLOCKS))
    rng.shuffle(blocks)
    reqs = []
    for i, (start, n) in enumerate(((900, 6), (700, 1), (0, 20), (300, 10))):
        size = -(-(start + n) // CHUNK)
        table, blocks = tuple(blocks[:size]), blocks[size:]
        ids = [rng.randrange(64) for _ in range(n)]
        reqs.append(ScheduledRequest(request_id=f"r{i}", block_table=table,
                                     ranges=[QueryRange(start, ids)], sample=True,
                                     sampling_params=SamplingParams(temperature=0.0),
                                     num_output_tokens=0))
    return SchedulerOutput(requests=reqs)


# The bucket's padding rows (no range) keep whatever their attention output held, and the
# interpreter's numpy may warn when the next RMSNorm squares them; no real row reads them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("decodes", ["together", "split"])
def test_split_graph_forward_matches_the_reference(model_and_cache, decodes: str,
                                                  monkeypatch) -> None:  # noqa: ANN001
    model, kv = model_and_cache
    g = MixedGraphs(model, kv, CHUNK, max_tokens=64, max_ranges=8, max_blocks=MAX_BLOCKS,
                    capture=False, decodes=decodes, span_mode="1", kv_splits=True)
    sched = _step(random.Random(1))
    bucket = g.fill(sched)
    assert bucket == 64 and g._items_splits(bucket) == 4  # 4 programs of 16 wanted (4 SMs)
    first = 1 if decodes == "split" else 0  # the decode's own launch takes the first range
    qlens = np.array([6, 1, 20, 10])[[0, 2, 3] if first else [0, 1, 2, 3]]
    unsplit = len(work_items_for(qlens, g.group, MIXED_TILES[0]))
    assert g._np32[-2] == 256  # the span: at least SPAN_ALIGN
    assert g._np32[-1] > unsplit  # the turn after 900 positions comes once per split
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("triton"))
    got = g._forward(bucket).clone()
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("reference"))
    want = g._forward(bucket)
    rows = len(sched.requests)  # the sampled rows; those past them are never read
    assert torch.isfinite(got[:rows]).all()
    torch.testing.assert_close(got[:rows], want[:rows], rtol=2e-4, atol=2e-4)
