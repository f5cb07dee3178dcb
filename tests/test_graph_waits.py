"""Per-group swap-in waits in mixed-step graphs (runner/graph_waits.py) and the step's order:
inputs up before its swaps are issued (runner/model_runner.py)."""

import random

import pytest
import torch

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.graph_waits import wait_layers
from pensieve.runner.swap_staged import layer_groups

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("layers,groups", [(40, 8), (40, 1), (5, 8), (7, 3)])
def test_wait_layers_are_the_first_of_each_staged_group(layers: int, groups: int) -> None:
    got = wait_layers("staged", layers, groups)
    assert got == [a for a, _ in layer_groups(layers, groups)]
    assert got[0] == 0 and got == sorted(set(got)) and len(got) == min(layers, groups)
    assert wait_layers("dma", layers, groups) == list(range(layers))


def _tiny_runner(tmp_path, num_cpu_blocks: int = 16):  # noqa: ANN001, ANN202
    import transformers

    from pensieve.engine.kv_layout import KVLayout
    from pensieve.models.loader import load_model
    from pensieve.runner.model_runner import ModelRunner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=16,
                      dtype=torch.float32)
    kv = layout.allocate(32, torch.device("cpu"))
    return ModelRunner(model, layout, kv, num_cpu_blocks=num_cpu_blocks)


def _step(swap_in: int) -> SchedulerOutput:
    """One request: a 20-token turn after 32 cached tokens, its two history chunks (blocks
    0, 1) swapped in from CPU blocks 0 .. swap_in - 1."""
    rng = random.Random(0)
    req = ScheduledRequest(request_id="r", block_table=(0, 1, 2, 3),
                           ranges=[QueryRange(32, [rng.randrange(128) for _ in range(20)])],
                           sample=True, sampling_params=SamplingParams(temperature=0.0),
                           num_output_tokens=0)
    return SchedulerOutput(requests=[req],
                           swaps=SwapPlan(swap_in=[(c, c) for c in range(swap_in)]))


def test_inputs_go_up_before_the_swaps_are_issued(tmp_path) -> None:  # noqa: ANN001
    """The runner uploads the step's inputs before it issues the step's swaps: on the GPU
    its uploads would otherwise queue behind the swap copies on the copy engines."""
    runner = _tiny_runner(tmp_path)
    calls: list[str] = []
    upload, start = runner._upload, runner.swapper.start_step

    def spy_upload(arrays):  # noqa: ANN001, ANN202
        calls.append("upload")
        return upload(arrays)

    def spy_start(plan, defer_background=False):  # noqa: ANN001, ANN202
        calls.append("swaps")
        return start(plan, defer_background)

    runner._upload = spy_upload
    runner.swapper.start_step = spy_start
    out = runner.execute(_step(2))
    assert calls == ["upload", "swaps"]
    assert list(out.sampled_token_ids) == ["r"]


def test_graphs_with_waits_take_steps_with_many_swap_ins(tmp_path) -> None:  # noqa: ANN001
    """Mixed-step graphs without per-group waits take only steps of at most
    ``graph_max_swap_in`` swap-ins; with waits, any."""
    runner = _tiny_runner(tmp_path)
    runner.enable_mixed_graphs(64, 4, 8, capture=False)  # the CPU: no graphs, no waits
    mixed = runner.mixed_graphs
    assert mixed is not None and mixed.layer_waits is None
    runner.graph_max_swap_in = 1
    assert runner._graphs_for(_step(1)) is mixed
    assert runner._graphs_for(_step(2)) is None
    mixed.layer_waits = object()  # stands for GraphLayerWaits (CUDA only)
    assert runner._graphs_for(_step(2)) is mixed


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_replayed_graph_waits_for_the_armed_event() -> None:
    """A captured wait on a fixed external event waits, at each replay, for the record made
    by ``arm`` before it: a slow producer on another stream writes what the graph reads."""
    from pensieve.runner.graph_waits import GraphLayerWaits

    dev = torch.device("cuda")
    waits = GraphLayerWaits([0, 1], dev)
    src = torch.zeros(1 << 20, device=dev)
    dst = torch.zeros_like(src)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            waits.wait(0)
            waits.wait(1)
            dst.copy_(src)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream(dev)
    for value in (1.0, 2.0, 3.0):
        events = []
        with torch.cuda.stream(producer):
            torch.cuda._sleep(50_000_000)  # tens of ms: the replay would run first
            src.fill_(value)
            events.append(torch.cuda.Event())
            events[-1].record(producer)

        def layer_ready(i: int, events: list = events) -> None:
            torch.cuda.current_stream().wait_event(events[0])

        waits.arm(layer_ready)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(dst == value), value
    # not armed: the fixed events hold completed records, the replay does not wait
    src.fill_(4.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(dst == 4.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_graphs_with_waits_give_the_tokens_of_graphs_that_wait_for_all(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Steps with swap-ins replayed with per-group waits (armed each such step) give the
    greedy tokens of replays that wait for all swap-ins first, under a tiny GPU tier."""
    from tiny_hf import assert_same_turns, tiny_swap_llama

    from pensieve import LLM
    from pensieve.runner import graph_waits

    common = tiny_swap_llama(tmp_path, num_layers=3)
    armed = []
    arm = graph_waits.GraphLayerWaits.arm

    def counting_arm(self, layer_ready):  # noqa: ANN001, ANN202
        armed.append(1)
        return arm(self, layer_ready)

    monkeypatch.setattr(graph_waits.GraphLayerWaits, "arm", counting_arm)
    with_waits = LLM(**common)
    all_first = LLM(**common)
    assert with_waits.engine.runner.mixed_graphs.layer_waits is not None
    all_first.engine.runner.mixed_graphs.layer_waits = None  # wait for all, as before
    assert_same_turns([with_waits, all_first], random.Random(0), rounds=3)
    assert with_waits.cache_stats()["swapped_in_tokens"] > 0
    assert armed, "no step with swap-ins replayed a graph with waits"


def test_decodes_split_give_the_logits_of_one_launch(tmp_path) -> None:  # noqa: ANN001
    """Mixed decodes ``split`` (the runner's default) on the CPU: a step with decodes at ragged
    positions, a request that recomputes its leading tokens beside a one-token turn, and a
    prefill turn, eagerly and through the static-buffer mixed-step graph path, split (ragged:
    max > 2x mean) and not (span ``0``): the logits of the sampled rows equal those of the decodes
    attended in one launch with the rest."""
    rng = random.Random(1)
    req = []
    blocks = iter(range(32))

    def add(rid: str, ranges: list[tuple[int, int]], ctx: int) -> None:
        table = tuple(next(blocks) for _ in range(ctx // 16 + 1))
        req.append(ScheduledRequest(
            request_id=rid, block_table=table,
            ranges=[QueryRange(s, [rng.randrange(128) for _ in range(n)]) for s, n in ranges],
            sample=True, sampling_params=SamplingParams(temperature=0.0), num_output_tokens=0))

    add("d0", [(3, 1)], 4)
    add("p", [(10, 30)], 40)
    add("d1", [(70, 1)], 71)
    add("r", [(0, 20), (40, 1)], 41)  # dropped leading tokens recomputed, one new token
    add("d2", [(17, 1)], 18)
    sched = SchedulerOutput(requests=req)
    logits = {}
    # span "0": decodes not to be split, so "split" leaves them with the rest (and the
    # graphs' decode launch empty)
    for mode, span in (("together", "auto"), ("split", "auto"), ("split", "0")):
        runner = _tiny_runner(tmp_path / f"{mode}{span}")
        runner.mixed_decodes, runner.decode_span_mode = mode, span
        torch.manual_seed(3)
        for t in runner.kv_caches:
            t.normal_()
        inp = runner.prepare_inputs(sched)
        assert (inp.attn.decode is not None) == (mode == "split" and span == "auto")
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.attn)
        logits[mode, span, "eager"] = runner.model.compute_logits(hidden[inp.logits_indices])
        runner.enable_mixed_graphs(128, 8, 8, capture=False)
        logits[mode, span, "graph"] = runner.mixed_graphs.run(sched)
    want = logits["together", "auto", "eager"]
    assert want.shape[0] == 5
    for key, got in logits.items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(key))

