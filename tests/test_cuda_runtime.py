"""CUDA runtime checks (skipped without a GPU): exact-size pinned store, the demand/prefetch streams,
cancellation, exactness on the device across modes, MXFP4 without syncs."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_model

from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_cuda_exact_generation_and_pinned_store(tiny_models, family):
    folder = tiny_models[family]
    ref = reference_model(folder).cuda()
    prompt = [5, 17, 99, 3, 200, 41]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    om = load_offloaded(folder, RuntimeConfig(device="cuda", cache_experts=4, predictor=Predictor.ROUTER),
                        StatsRecorder())
    try:
        assert om.device == torch.device("cuda", torch.cuda.current_device())  # always indexed
        assert om.store.pinned and om.store.buffer.is_pinned() and om.cache.slots.is_cuda
        assert om.store._pinned.nbytes == om.store.total_bytes  # exact size, not a power of two
        assert om.recorder.synchronize == om.cache.engine.synchronize  # wired at load
        got = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=10)))
        steps = om.recorder.steps
    finally:
        om.close()
    assert got == want
    eb = om.store.expert_bytes
    for s in steps:
        t = s.total()
        assert t.h2d_bytes == (t.misses + t.prefetched) * eb


@pytest.mark.parametrize("mode", list(ExecuteMode))
def test_cuda_modes_multi_turn(tiny_models, mode):
    """A two-turn conversation on CUDA through 4 slots (two streams, pump thread, cancellations) gives,
    in exact mode, the tokens of the same model with every expert resident (same device, so
    bit-identical); in every mode the bytes the engine moved are the bytes the stats counted."""
    folder = tiny_models["qwen3_moe"]

    def talk(**kw):
        om = load_offloaded(folder, RuntimeConfig(device="cuda", execute=mode, fetch_threshold=0.3, **kw),
                            StatsRecorder())
        try:
            eng, ids, out = Engine(om), [], []
            for turn in ([3, 14, 15, 92, 65, 35], [89, 79, 32]):
                ids = ids + turn
                new = list(eng.generate(ids, SamplingConfig(max_new_tokens=6)))
                out, ids = out + new, ids + new
            om.cache.engine.synchronize()
            moved = om.cache.engine.bytes_moved
            counted = sum(s.total().h2d_bytes for s in om.recorder.steps)
            return out, moved, counted
        finally:
            om.close()

    small, moved, counted = talk(cache_experts=4, predictor=Predictor.ROUTER)
    assert moved == counted
    if mode == ExecuteMode.EXACT:
        full, _, _ = talk(predictor=Predictor.NONE)  # every expert fits: no offloading pressure
        assert small == full
    else:
        assert len(small) == 12


def _engine_fixture(n: int, nbytes: int = 32 << 20):  # ~0.7 ms per copy at 50 GB/s
    from moespec.runtime.host.memory import PinnedBuffer
    from moespec.runtime.transfer.cuda import CudaTransferEngine

    dev = torch.device("cuda", torch.cuda.current_device())
    host = PinnedBuffer(n * nbytes, dev)
    rows = host.tensor.view(n, nbytes)
    rows.copy_(torch.arange(n, dtype=torch.uint8).view(n, 1).expand(n, nbytes))
    slots = torch.zeros(n, nbytes, dtype=torch.uint8, device=dev)
    return host, rows, slots, CudaTransferEngine(dev, n)


def test_demand_copy_lands_before_queued_prefetches():
    host, rows, slots, eng = _engine_fixture(17)
    eng.set_timing(True)
    ref = eng.mark()
    pre = [eng.submit(slots[i], rows[i], i, prefetch=True) for i in range(16)]
    demand = eng.submit(slots[16], rows[16], 16)
    eng.wait(demand)
    eng.synchronize()
    ms = lambda ev: ref.elapsed_time(ev)  # noqa: E731
    assert ms(demand.end) < ms(pre[-1].end)  # one FIFO stream would land it after all 16
    assert ms(demand.end) < ms(pre[4].end)
    assert torch.equal(slots[16].cpu(), rows[16]) and all(torch.equal(slots[i].cpu(), rows[i]) for i in range(16))
    eng.close()
    host.close()


def test_cancelled_prefetches_never_land():
    host, rows, slots, eng = _engine_fixture(8, 64 << 20)
    tickets = [eng.submit(slots[i], rows[i], i, prefetch=True) for i in range(8)]
    cancelled = [i for i, t in enumerate(tickets) if eng.cancel(t)]
    eng.synchronize()
    assert cancelled  # the window (2) released the first ones; the rest were still on the host
    assert eng.bytes_moved == (8 - len(cancelled)) * rows.shape[1]
    for i in range(8):
        assert int(slots[i, 0]) == (0 if i in cancelled else i)
    eng.close()
    host.close()


def test_mxfp4_dequantize_on_cuda_is_exact_and_does_not_sync():
    from moespec.models import mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (64, 90, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (64, 90), dtype=torch.uint8, generator=g)
    ref = mxfp4.dequantize_reference(blocks, scales, torch.bfloat16)
    b, s = blocks.cuda(), scales.cuda()
    mxfp4.dequantize(b, s, torch.bfloat16)  # builds the cached tables (the one host->device copy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mxfp4.dequantize(b, s, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), ref)


def test_hybrid_timing_synchronizes_the_named_device():
    from moespec.estimator.hybrid import time_per_call_ms

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(256, 256, device=dev)
    assert time_per_call_ms(lambda: x @ x, dev, repeats=3, warmup=1) > 0
