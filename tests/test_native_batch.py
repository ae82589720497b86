"""NativeExpertBatch (one C call per thread for a layer's host experts): the same bits as the layout's
forward on a pool worker, for every row format and token count it takes; ExpertBatch elsewhere."""

from __future__ import annotations

import time

import pytest
import torch

from moespec.kernels import native
from moespec.kernels.expert_batch import ExpertBatch, Split
from moespec.runtime.misses.native_batch import NativeExpertBatch, native_plan
from moespec.models.layout import ExpertLayout
from moespec.models.quant_layout import QuantLayout
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.misses.host_pool import HostExpertPool

pytestmark = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
ACT = torch.nn.functional.silu
H, I = 128, 48  # noqa: E741


def _store(fmt: str, experts: int = 6) -> tuple[ExpertStore, torch.dtype]:
    if fmt in ("float32", "bfloat16"):
        layout, dtype = ExpertLayout(H, I), getattr(torch, fmt)
    else:
        layout = QuantLayout(H, I, bits=4 if fmt in ("int4", "w4a8") else 8, group_size=32,
                             act_int8=fmt.startswith("w"))
        dtype = torch.float32
    store = ExpertStore([0, 1], experts, layout, dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in (0, 1):
        for e in range(experts):
            row = store.expert(layer, e)
            if fmt in ("float32", "bfloat16"):
                row.copy_(torch.randn(row.numel(), generator=gen) * 0.05)
                continue
            row.copy_(torch.randint(0, 256, (row.numel(),), dtype=torch.uint8, generator=gen))
            for name in ("gate_up_scales", "down_scales"):
                v = layout.views(row)[name].view(torch.float16)
                v.copy_(torch.rand(v.numel(), generator=gen) * 0.02 + 1e-3)
    return store, dtype


def _on_worker(pool: HostExpertPool, layout, x, row) -> torch.Tensor:
    """The layout's forward as a pool worker runs it (one intra-op thread): the reference."""
    return pool.run_on_worker(lambda: layout.forward(x, row, ACT))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("threads,helps", [(1, False), (1, True), (2, True)])
def test_a_native_batch_equals_the_layouts_forward_bit_for_bit(fmt, threads, helps):
    store, dtype = _store(fmt)
    gen = torch.Generator().manual_seed(1)
    tokens = [1, 3, 16, 1, 2, 5]
    items = [(e, torch.randn(t, H, generator=gen).to(dtype)) for e, t in enumerate(tokens)]
    pool = HostExpertPool(store, torch.device("cpu"), threads, Split.EXPERTS, caller_helps=helps)
    try:
        t0 = time.perf_counter()
        jobs = pool.submit_layer(1, items, ACT)
        assert all(isinstance(pool_batch, NativeExpertBatch) for pool_batch in [_batch_of(jobs, pool)])
        got = [j.result() for j in jobs]
        t1 = time.perf_counter()
        layout = store.layout.for_layer(1)
        for (e, x), done in zip(items, got):
            want = _on_worker(pool, layout, x, store.expert(1, e))
            assert done.raw.dtype == dtype and done.raw.shape == x.shape
            assert torch.equal(done.raw, want), (fmt, e)
            # the C clock is perf_counter's: each expert ran inside the submit-to-result window
            assert t0 <= done.start <= done.end <= t1 and done.host_ms == pytest.approx((done.end - done.start) * 1e3)
    finally:
        pool.close()


def _batch_of(jobs, pool):
    """The batch behind ``jobs`` (the future's owner): the helper, or the waiting function's object."""
    job = jobs[0]
    return job.batch if job.batch is not None else job.wait.__self__


def test_a_layout_with_its_own_forward_or_another_activation_keeps_the_python_batch():
    store, _ = _store("int4")
    x = torch.randn(1, H)

    class Own(QuantLayout):
        def forward(self, x, row, act):  # e.g. GPT-OSS's MXFP4 experts
            return super().forward(x, row, act)

    own = Own(H, I, bits=4, group_size=32)
    assert native_plan(store.layout, torch.uint8, [x], ACT) is not None
    assert native_plan(own, torch.uint8, [x], ACT) is None
    assert native_plan(store.layout, torch.uint8, [x], torch.nn.functional.gelu) is None
    assert native_plan(store.layout, torch.uint8, [torch.randn(17, H)], ACT) is None  # a prefill chunk
    pool = HostExpertPool(store, torch.device("cpu"), 1, Split.EXPERTS)
    try:
        x17 = torch.randn(17, H)
        jobs = pool.submit_layer(0, [(0, x17)], ACT)
        assert isinstance(jobs[0].batch, ExpertBatch) and jobs[0].wait is None
        assert torch.equal(jobs[0].result().raw, _on_worker(pool, store.layout, x17, store.expert(0, 0)))
    finally:
        pool.close()


def test_a_batch_cut_by_rows_stays_a_python_batch():
    """Fewer experts than workers: AUTO cuts them by rows (ExpertBatch), the native batch only takes whole experts."""
    store, _ = _store("int8")
    pool = HostExpertPool(store, torch.device("cpu"), 2, Split.AUTO)
    try:
        jobs = pool.submit_layer(0, [(2, torch.randn(1, H))], ACT)
        assert isinstance(jobs[0].batch, ExpertBatch)
        jobs[0].result()
    finally:
        pool.close()


def test_an_error_loading_the_tokens_reaches_the_caller():
    store, _ = _store("int4")
    layout = store.layout
    plan = native_plan(layout, torch.uint8, [torch.randn(1, H)], ACT)

    def load(x):
        raise RuntimeError("d2h failed")

    batch = NativeExpertBatch(layout, plan, [torch.randn(1, H)], [store.expert(0, 0).data_ptr()], load=load)
    batch.run()
    batch.run()  # a second thread after the failure: nothing more, no second error
    with pytest.raises(RuntimeError, match="d2h failed"):
        batch.result()


def test_threads_that_arrive_after_every_expert_was_claimed_return_at_once():
    store, _ = _store("int4")
    x = torch.randn(1, H)
    plan = native_plan(store.layout, torch.uint8, [x], ACT)
    batch = NativeExpertBatch(store.layout, plan, [x, x], [store.expert(0, e).data_ptr() for e in (0, 1)])
    batch.run()  # this thread computed both
    assert batch.future.done()
    first = batch.result()
    batch.run()  # late: nothing to claim, the result is unchanged
    assert batch.result() is first and len(first) == 2
    assert torch.equal(first[1].y, store.layout.forward(x, store.expert(0, 1), ACT))


def test_tokens_loaded_and_outputs_stored_by_the_threads_as_on_cuda():
    """The CUDA shape of a batch (tokens to bring to the host, outputs to copy back): the first
    thread loads every expert's tokens, the one that finishes the last expert stores the outputs
    once; a caller waiting on such a batch sleeps on the future (no spin: a worker must copy)."""
    store, _ = _store("int8")
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(t, H, generator=gen) for t in (1, 4, 2)]
    plan = native_plan(store.layout, torch.uint8, xs, ACT)
    loads, stores = [], []
    batch = NativeExpertBatch(store.layout, plan, xs, [store.expert(0, e).data_ptr() for e in range(3)],
                              load=lambda x: loads.append(1) or x.clone(),
                              store=lambda y: stores.append(y.shape) or y.clone())
    assert not loads  # nothing loaded before a thread runs the batch
    pool = HostExpertPool(store, torch.device("cpu"), 2)
    try:
        for _ in range(2):
            pool._pool.submit(batch.run)
        out = batch.result(spin=True)
    finally:
        pool.close()
    assert len(loads) == 3 and stores == [(7, H)]
    for e, x in enumerate(xs):
        assert torch.equal(out[e].y, store.layout.forward(x, store.expert(0, e), ACT))
