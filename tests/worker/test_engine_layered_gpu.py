"""Layered loads on CUDA: a layer is readable once it landed, later layers still copying, and never before."""

import pytest
import torch

from kvkit.interfaces import KVCacheSpec, TransferPlan
from kvkit.interfaces.capabilities import LayeredCopy
from kvkit.registry import COPY
from kvkit.testing.kvdata import fill_random, tensor_bytes
from kvkit.worker.engine import TransferEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
BLOCKS = 64
HOLD_CYCLES = 400_000_000  # ~0.2 s of GPU sleep: far longer than a warm load's launch and copy


class NoWaitEngine(TransferEngine):
    """The planted bug: a layer is read without waiting for its load."""

    def wait_layer(self, layer, stream=None, timeout=None):
        return None


def _held_back_load(engine_type, backend, cpu_layout=None):
    """Load every block with the last layer held back; read layer 0, then the last layer, each after its wait.

    Returns whether layer 0 was readable while the last layer was still held back.
    Raises AssertionError if a read saw bytes the load had not written yet.
    """
    engine = engine_type(SPEC, COPY.create(backend), num_cpu_blocks=BLOCKS)
    gpu = engine.allocate_kv(BLOCKS, "per-layer", "cuda", cpu_layout=cpu_layout)
    fill_random(engine.cpu_kv, seed=11)
    plan = TransferPlan(list(range(BLOCKS)), list(range(BLOCKS)), "load")
    # One unheld load first: a backend's first-use setup (kernel builds, host registration) must not
    # run inside the hold, or the held layer may land before it is read and the planted bug goes unseen.
    engine.submit(0, plan, layered=True)
    engine.drain()
    for t in gpu:
        t.zero_()
    expected = [torch.stack([engine.block_pieces("cpu", b)[2 * layer + half] for b in range(BLOCKS)]).to("cuda")
                .view_as(gpu[layer][half]) for layer in range(SPEC.num_layers) for half in (0, 1)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(HOLD_CYCLES)
        held = torch.cuda.Event()
        held.record(side)
    last = SPEC.num_layers - 1
    engine.submit(1, plan, layered=True, written={last: held})  # the last layer's stage waits for the sleeping stream
    engine.wait_layer(0)
    first = gpu[0].clone()
    read_first = torch.cuda.Event()
    read_first.record()
    read_first.synchronize()
    overlapped = not held.query()
    engine.wait_layer(last)
    final = gpu[last].clone()
    torch.cuda.synchronize()
    engine.drain()
    # Bytes, not values: random bf16 bytes hold NaNs, which never compare equal.
    assert torch.equal(tensor_bytes(first), tensor_bytes(torch.stack(expected[0:2]))), (
        "layer 0 was read before its load landed")
    assert torch.equal(tensor_bytes(final), tensor_bytes(torch.stack(expected[2 * last:2 * last + 2]))), (
        "the last layer was read before its load landed")
    return overlapped


@pytest.mark.parametrize("backend", ["torch", "cuda-dma", "cupy-batch", "auto"])
def test_a_layer_is_read_after_its_own_load_while_later_layers_still_copy(backend):
    """Layer 0 is read correctly while the last layer is held back; the last layer only once it landed."""
    if not COPY.available(backend):
        pytest.skip(f"{backend} is unavailable here")
    assert isinstance(COPY.create(backend), LayeredCopy)
    assert _held_back_load(TransferEngine, backend), "layer 0 waited for the held-back last layer"


def test_a_backend_without_stages_is_waited_for_whole():
    """``staged`` moves whole CPU blocks (every layer in one piece): a layer waits for the whole load, correctly."""
    if not COPY.available("staged"):
        pytest.skip("staged is unavailable here")
    assert not isinstance(COPY.create("staged"), LayeredCopy)
    _held_back_load(TransferEngine, "staged", cpu_layout="cross-layer")


@pytest.mark.parametrize("backend", ["cupy-batch", "torch"])
def test_the_check_fails_when_the_wait_is_removed(backend):
    """Planted bug: without the wait the held-back layer is read before it landed, and the check says so."""
    if not COPY.available(backend):
        pytest.skip(f"{backend} is unavailable here")
    with pytest.raises(AssertionError, match="the last layer was read before its load landed"):
        _held_back_load(NoWaitEngine, backend)
