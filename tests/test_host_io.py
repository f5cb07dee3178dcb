"""The step's host transfers through mapped host arrays (runner/host_io.py).

Without CUDA the copy kernel runs through Triton's interpreter on CPU tensors (the host array
stands for the mapped one); with CUDA the arrays are page-locked and device-mapped, and a
runner with ``PENSIEVE_HOST_IO=mapped`` gives the tokens of the copying one.
"""

import random

import pytest
import torch

from pensieve.kernels.launch_swap import copy_words
from pensieve.runner import host_io
from pensieve.runner.host_io import MappedArray, MappedReadback, StepUploads

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 3000])
def test_copy_words_matches_copy(dtype: torch.dtype, n: int) -> None:
    src = torch.randint(-2**31, 2**31 - 1, (3000,), dtype=dtype, device=DEV)
    dst = torch.full((3100,), 7, dtype=dtype, device=DEV)
    want = dst.clone()
    want[:n] = src[:n]
    copy_words(src, dst, n)
    assert torch.equal(dst, want)


def test_copy_words_rejects_bad_arguments() -> None:
    a = torch.zeros(10, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="one dtype"):
        copy_words(a, torch.zeros(10, dtype=torch.int32, device=DEV), 5)
    with pytest.raises(ValueError, match="do not fit"):
        copy_words(a, torch.zeros(5, dtype=torch.int64, device=DEV), 6)
    with pytest.raises(ValueError, match="do not fit"):
        copy_words(a, a.clone(), -1)
    with pytest.raises(ValueError, match="contiguous"):
        copy_words(a[::2], torch.zeros(10, dtype=torch.int64, device=DEV), 3)


def test_step_uploads_pack_and_grow() -> None:
    """Arrays of both dtypes come back in order and intact, step after step, also once an
    array outgrows its mapped buffer (which then grows)."""
    up = StepUploads(DEV)
    rng = random.Random(0)
    for step in range(4):
        sizes = [rng.randint(0, 50) for _ in range(5)] + ([70_000] if step == 2 else [])
        arrays = [([rng.randrange(-2**31, 2**31) for _ in range(k)],
                   torch.int64 if i % 2 else torch.int32) for i, k in enumerate(sizes)]
        got = up.upload(arrays)
        assert len(got) == len(arrays)
        for t, (values, dt) in zip(got, arrays, strict=True):
            assert t.dtype == dt and t.device.type == DEV.type
            assert t.tolist() == values


def test_mapped_readback_reads_and_grows() -> None:
    rb = MappedReadback(DEV, n=8)
    for n in (0, 3, 8, 100):
        t = torch.randint(0, 50_000, (n,), device=DEV)
        assert rb.read(t) == t.tolist()


def test_host_io_mode_rejects_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PENSIEVE_HOST_IO", raising=False)
    assert host_io.host_io_mode() == "copy"  # the default: mapped did not gain in serving
    monkeypatch.setenv("PENSIEVE_HOST_IO", "zero-copy")
    with pytest.raises(ValueError, match="PENSIEVE_HOST_IO"):
        host_io.host_io_mode()
    monkeypatch.setenv("PENSIEVE_HOST_IO", "mapped")
    assert host_io.host_io_mode() == "mapped"


def test_runner_inputs_same_both_ways(tmp_path) -> None:  # noqa: ANN001
    """``prepare_inputs`` through mapped arrays gives the tensors of the pinned copies, for a
    mixed step and a ragged decode step (split by span)."""
    from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
    from pensieve.core.sampling_params import SamplingParams
    from pensieve.runner.model_runner import ModelRunner, allocate_kv_caches

    caches = allocate_kv_caches(2, 32, 4, 2, 8, torch.float32, DEV)
    runner = ModelRunner(torch.nn.Identity(), caches, 4)
    runner.decode_span_mode = "1"

    def req(i: int, start: int, n: int, blocks: list[int]) -> ScheduledRequest:
        rng = QueryRange(start_pos=start, token_ids=list(range(10 + i, 10 + i + n)))
        return ScheduledRequest(request_id=f"r{i}", ranges=[rng], block_table=tuple(blocks),
                                sample=True, sampling_params=SamplingParams(),
                                num_output_tokens=0)

    steps = [SchedulerOutput(requests=[req(0, 0, 7, [3, 5]), req(1, 4, 1, [1, 2, 9])]),
             SchedulerOutput(requests=[req(0, 7, 1, [3, 5]), req(1, 5, 1, [1, 2, 9]),
                                       req(2, 40, 1, list(range(11, 22)))])]
    for sched in steps:
        runner._uploads = None
        want = runner.prepare_inputs(sched)
        runner._uploads = StepUploads(DEV)
        got = runner.prepare_inputs(sched)
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("slot_mapping", "query_start_loc", "range_start_pos", "range_table",
                     "block_tables", "kv_split_span"):
            a, b = getattr(got.attn, name), getattr(want.attn, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), name
        assert got.attn.num_kv_splits == want.attn.num_kv_splits
        assert got.attn.max_query_len == want.attn.max_query_len


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_mapped_arrays_are_unregistered_when_collected_or_grown() -> None:
    """A collected or replaced mapped array gives its registration back: registering the same
    host memory again works (cudaHostRegister fails on memory still registered)."""
    import gc

    from pensieve.kernels.launch_swap import register_host, unregister_host

    a = MappedArray(4096, torch.int64, DEV)
    first = a.host
    a.reserve(3 * 4096)  # grows: the first host array is unregistered
    m = register_host(first, DEV)
    unregister_host(m.tensor)
    host = a.host
    del a
    gc.collect()
    m = register_host(host, DEV)
    unregister_host(m.tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_mapped_runner_gives_the_same_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Graphs and eager steps, with swaps under a tiny GPU tier: the same greedy tokens with
    the step's transfers through mapped host arrays as through copies."""
    from tiny_hf import assert_same_turns, tiny_swap_llama

    from pensieve import LLM

    common = tiny_swap_llama(tmp_path)
    llms = {}
    for mode in ("copy", "mapped"):
        monkeypatch.setenv("PENSIEVE_HOST_IO", mode)
        llms[mode] = LLM(**common)
    assert llms["mapped"].engine.runner._readback is not None
    assert llms["copy"].engine.runner._readback is None
    assert_same_turns(list(llms.values()), random.Random(0), rounds=3)
    assert llms["mapped"].cache_stats()["swapped_in_tokens"] > 0
