"""The swapper's block-copy kernel (kernels/triton_swap.py) against its torch reference.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (what CI runs). With
CUDA the same cases run natively on GPU tensors, and the ``gpu`` cases copy between the GPU
and pinned, device-mapped host memory (``MappedHost``), as the swapper uses it. Comparisons
are bit for bit (the kernel copies raw words): the inputs are random bits, NaN payloads and
negative zeros included, which any float conversion would change.
"""

import random
import zlib

import pytest
import torch

from pensieve.kernels import launch_swap
from pensieve.kernels.launch_swap import MappedHost, swap_blocks_triton
from pensieve.kernels.reference import swap_blocks_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def tier(layers: int, blocks: int, block: tuple[int, int, int], dtype: torch.dtype,
         device: str = DEVICE) -> torch.Tensor:
    """Random bits (NaN payloads, -0.0 and all) of ``[layers, 2, blocks, *block]``."""
    per = torch.empty((), dtype=dtype).element_size() // 2  # int16 halves per element
    shape = (layers, 2, blocks, *block[:-1], block[-1] * per)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16).view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({F32: torch.int32}.get(t.dtype, torch.int16)).cpu()


def random_pairs(rng: random.Random, n: int, n_src: int, n_dst: int) -> torch.Tensor:
    """``n`` pairs, sources and destinations in random order, destinations distinct."""
    src = [rng.randrange(n_src) for _ in range(n)]  # sources may repeat
    dst = rng.sample(range(n_dst), n)
    pairs = torch.tensor(list(zip(src, dst, strict=True)), dtype=torch.int64).view(-1, 2)
    return pairs.to(DEVICE)


def check(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, **kw: int) -> None:
    want = dst.clone()
    swap_blocks_ref(src, want, pairs)
    swap_blocks_triton(src, dst, pairs, **kw)
    assert torch.equal(bits(dst), bits(want))


@pytest.mark.parametrize("dtype", [BF16, F32, F16])
@pytest.mark.parametrize("direction", ["in", "out"])
@pytest.mark.parametrize("n", [1, 5, 17])
def test_matches_reference(dtype: torch.dtype, direction: str, n: int) -> None:
    """GPU-like tier (24 blocks) and CPU-like tier (40 blocks), either way, random ids."""
    rng = random.Random(f"{dtype}{direction}{n}")
    gpu_t, cpu_t = tier(3, 24, (4, 2, 8), dtype), tier(3, 40, (4, 2, 8), dtype)
    src, dst = (cpu_t, gpu_t) if direction == "in" else (gpu_t, cpu_t)
    pairs = random_pairs(rng, n, src.shape[2], dst.shape[2])
    before_src = bits(src)
    check(src, dst, pairs, num_programs=4)
    assert torch.equal(bits(src), before_src)  # the source is only read


@pytest.mark.parametrize("start,stop", [(0, 1), (1, 3), (2, 5), (0, 5)])
def test_layer_ranges_touch_only_their_layers(start: int, stop: int) -> None:
    rng = random.Random(start * 10 + stop)
    src, dst = tier(5, 12, (4, 2, 8), BF16), tier(5, 9, (4, 2, 8), BF16)
    pairs = random_pairs(rng, 6, 12, 9)
    want = dst.clone()
    swap_blocks_ref(src[start:stop], want[start:stop], pairs)
    swap_blocks_triton(src[start:stop], dst[start:stop], pairs, num_programs=3)
    assert torch.equal(bits(dst), bits(want))


@pytest.mark.parametrize("programs", [1, 2, 7, 64, 1000])
def test_persistent_grid_covers_every_item(programs: int) -> None:
    """Fewer programs than items (each loops), and more (the grid is capped at the items)."""
    rng = random.Random(programs)
    src, dst = tier(2, 20, (2, 2, 8), F16), tier(2, 20, (2, 2, 8), F16)
    check(src, dst, random_pairs(rng, 11, 20, 20), num_programs=programs)


@pytest.mark.parametrize("block,dtype,tile_bytes", [
    ((4, 2, 8), BF16, 16384),   # 128 B block: int64 words, one tile
    ((4, 2, 8), BF16, 32),      # several tiles per block
    ((3, 1, 5), BF16, 16),      # 30 B block: int16 words, a masked last tile
    ((3, 1, 3), F32, 8),        # 36 B block: int32 words, masked
    ((2, 3, 16), F16, 64),      # 192 B: int64 words, 3 tiles
])
def test_word_sizes_and_tiles(block: tuple[int, int, int], dtype: torch.dtype,
                              tile_bytes: int) -> None:
    rng = random.Random(str(block))
    src, dst = tier(2, 7, block, dtype), tier(2, 11, block, dtype)
    check(src, dst, random_pairs(rng, 5, 7, 11), num_programs=3, tile_bytes=tile_bytes)


def test_word_size_choice() -> None:
    assert launch_swap._word_size([81920, 0, 163840]) == 8
    assert launch_swap._word_size([36, 0, 72]) == 4
    assert launch_swap._word_size([30, 0, 60]) == 2
    assert launch_swap._word_size([15, 0]) == 1


def test_strided_tiers() -> None:
    """Any strides above a block: here the block dim outermost, layers inside."""
    rng = random.Random(1)
    src = tier(3, 10, (4, 2, 8), BF16).permute(2, 0, 1, 3, 4, 5).contiguous()
    src = src.permute(1, 2, 0, 3, 4, 5)  # [L, 2, N, ...] view with N outermost in memory
    dst = tier(3, 6, (4, 2, 8), BF16)
    check(src, dst, random_pairs(rng, 4, 10, 6), num_programs=5)


@pytest.mark.parametrize("direction", ["in", "out"])
@pytest.mark.parametrize("start,stop", [(0, 3), (1, 2)])
def test_chunk_major_tier(direction: str, start: int, stop: int) -> None:
    """The staged swapper's host tier: ``[blocks, L, 2, C, Hkv, D]`` seen as ``[L, 2, blocks,
    ...]`` (permuted strides), either way, with layer ranges."""
    rng = random.Random(f"{direction}{start}")
    host = tier(3, 10, (4, 2, 8), BF16).permute(2, 0, 1, 3, 4, 5).contiguous()
    host = host.permute(1, 2, 0, 3, 4, 5)
    dev = tier(3, 8, (4, 2, 8), BF16)
    src, dst = (host, dev) if direction == "in" else (dev, host)
    pairs = random_pairs(rng, 5, src.shape[2], dst.shape[2])
    want = dst.clone()
    swap_blocks_ref(src[start:stop], want[start:stop], pairs)
    swap_blocks_triton(src[start:stop], dst[start:stop], pairs, num_programs=4)
    assert torch.equal(bits(dst), bits(want))


def test_empty_is_a_no_op() -> None:
    src, dst = tier(2, 4, (4, 2, 8), BF16), tier(2, 4, (4, 2, 8), BF16)
    before = bits(dst)
    swap_blocks_triton(src, dst, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    swap_blocks_triton(src[:0], dst[:0], torch.tensor([[0, 1]], device=DEVICE))
    assert torch.equal(bits(dst), before)


@pytest.mark.parametrize("case", ["ndim", "kv", "dtype", "layers", "block", "pairs_dtype",
                                  "pairs_shape", "noncontig_block", "programs"])
def test_launcher_rejects(case: str) -> None:
    src, dst = tier(2, 4, (4, 2, 8), BF16), tier(2, 5, (4, 2, 8), BF16)
    pairs = torch.tensor([[0, 1]], device=DEVICE)
    kw: dict[str, int] = {}
    if case == "ndim":
        src = src[0]
    elif case == "kv":
        src = torch.cat([src, src], 1)
    elif case == "dtype":
        dst = dst.to(F16)
    elif case == "layers":
        dst = dst[:1]
    elif case == "block":
        dst = tier(2, 5, (4, 2, 16), BF16)
    elif case == "pairs_dtype":
        pairs = pairs.to(torch.int32)
    elif case == "pairs_shape":
        pairs = pairs.view(-1)
    elif case == "noncontig_block":
        src = tier(2, 4, (4, 8, 2), BF16).transpose(4, 5)
    elif case == "programs":
        kw["num_programs"] = 0
    with pytest.raises(ValueError):
        swap_blocks_triton(src, dst, pairs, **kw)


def test_reference_semantics() -> None:
    src = torch.arange(2 * 2 * 3 * 2, dtype=F32).view(2, 2, 3, 2, 1, 1)
    dst = torch.zeros(2, 2, 4, 2, 1, 1)
    swap_blocks_ref(src, dst, torch.tensor([[2, 0], [0, 3]]))
    assert torch.equal(dst[:, :, 0], src[:, :, 2])
    assert torch.equal(dst[:, :, 3], src[:, :, 0])
    assert not dst[:, :, 1:3].any()


# ---------------------------------------------------------------- CUDA: mapped host memory


@pytest.fixture
def mapped() -> object:
    """A function registering a host tensor (mapped) and undoing it after the test."""
    done: list[torch.Tensor] = []

    def make(t: torch.Tensor) -> MappedHost:
        done.append(t)
        return launch_swap.register_host(t, torch.device("cuda"))

    yield make
    torch.cuda.synchronize()
    for t in done:
        launch_swap.unregister_host(t)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, F32, F16])
@pytest.mark.parametrize("direction", ["in", "out"])
@pytest.mark.parametrize("programs", [1, 16, 132])
def test_cuda_mapped_host_matches_reference(mapped, dtype: torch.dtype, direction: str,  # noqa: ANN001
                                            programs: int) -> None:
    rng = random.Random(f"{dtype}{direction}{programs}")
    layers, block = 4, (32, 10, 128)
    dev = tier(layers, 200, block, dtype, "cuda")
    host = tier(layers, 300, block, dtype, "cpu")
    m = mapped(host)
    n = 150
    if direction == "in":
        pairs = random_pairs(rng, n, 300, 200).cpu()
        want = dev.cpu()
        swap_blocks_ref(host, want, pairs)
        swap_blocks_triton(m, dev, pairs.cuda(), num_programs=programs)
        torch.cuda.synchronize()
        assert torch.equal(bits(dev), bits(want))
    else:
        pairs = random_pairs(rng, n, 200, 300).cpu()
        want = host.clone()
        swap_blocks_ref(dev.cpu(), want, pairs)
        swap_blocks_triton(dev, m, pairs.cuda(), num_programs=programs)
        torch.cuda.synchronize()
        assert torch.equal(bits(host), bits(want))


@pytest.mark.gpu
@needs_cuda
def test_cuda_layer_slices_of_mapped_host(mapped) -> None:  # noqa: ANN001
    rng = random.Random(0)
    dev = tier(5, 40, (32, 10, 128), BF16, "cuda")
    host = tier(5, 60, (32, 10, 128), BF16, "cpu")
    m = mapped(host)
    pairs = random_pairs(rng, 30, 60, 40).cpu()
    want = dev.cpu()
    swap_blocks_ref(host[2:4], want[2:4], pairs)
    swap_blocks_triton(m[2:4], dev[2:4], pairs.cuda())
    torch.cuda.synchronize()
    assert torch.equal(bits(dev), bits(want))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["in", "out"])
def test_cuda_chunk_major_mapped_host(mapped, direction: str) -> None:  # noqa: ANN001
    """The staged swapper's host tier: chunk-major pinned memory, ``MappedHost.permute`` to
    the kernel's ``[L, 2, blocks, ...]`` view; all layers and a layer slice."""
    rng = random.Random(direction)
    layers, block = 5, (32, 10, 128)
    dev = tier(layers, 64, block, BF16, "cuda")
    host = tier(layers, 80, block, BF16, "cpu").permute(2, 0, 1, 3, 4, 5).contiguous()
    m = mapped(host).permute(1, 2, 0, 3, 4, 5)
    view = host.permute(1, 2, 0, 3, 4, 5)
    assert m.device_ptr == host.data_ptr() and m.tensor.stride() == view.stride()
    for start, stop in ((0, layers), (2, 4)):
        if direction == "in":
            pairs = random_pairs(rng, 40, 80, 64).cpu()
            want = dev.cpu()
            swap_blocks_ref(view[start:stop], want[start:stop], pairs)
            swap_blocks_triton(m[start:stop], dev[start:stop], pairs.cuda())
            torch.cuda.synchronize()
            assert torch.equal(bits(dev), bits(want))
        else:
            pairs = random_pairs(rng, 40, 64, 80).cpu()
            want = view.clone()
            swap_blocks_ref(dev[start:stop].cpu(), want[start:stop], pairs)
            swap_blocks_triton(dev[start:stop], m[start:stop], pairs.cuda())
            torch.cuda.synchronize()
            assert torch.equal(bits(view), bits(want))


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_pointer_of_mapped_host(mapped) -> None:  # noqa: ANN001
    """With unified addressing the device address of registered memory is the host one."""
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    m = mapped(host)
    assert m.device_ptr == host.data_ptr()
    assert host.is_pinned()
    assert m[16:32].device_ptr == m.device_ptr + 16


@pytest.mark.gpu
@needs_cuda
def test_cuda_rejects_plain_cpu_tensor() -> None:
    dev = tier(1, 4, (4, 2, 8), BF16, "cuda")
    with pytest.raises(ValueError):
        swap_blocks_triton(tier(1, 4, (4, 2, 8), BF16, "cpu"), dev,
                           torch.tensor([[0, 0]]).cuda())
