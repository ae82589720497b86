"""HostExpertPool's one dispatch per layer: the waiting caller runs the units no worker took, and an
expert unit builds no weight views it does not use."""

from __future__ import annotations

import threading

import pytest
import torch

from moespec.kernels import native
from moespec.kernels.expert_batch import Split
from moespec.models.quant_layout import QuantLayout
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.misses.host_pool import HostExpertPool

pytestmark = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
ACT = torch.nn.functional.silu


def _store(experts: int = 4) -> ExpertStore:
    layout = QuantLayout(hidden=64, intermediate=32, bits=4, group_size=32)
    store = ExpertStore([0], experts, layout, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for e in range(experts):
        row = store.expert(0, e)
        row.copy_(torch.randint(0, 256, (row.numel(),), dtype=torch.uint8, generator=gen))
        for name in ("gate_up_scales", "down_scales"):
            layout.views(row)[name].view(torch.float16).fill_(0.01)
    return store


@pytest.mark.parametrize("split", [Split.EXPERTS, Split.ROWS])
def test_the_caller_computes_the_batch_while_every_worker_is_busy(split):
    """The only worker is held by another job: result() still returns, computed on the caller's thread,
    equal to the layout's forward."""
    store = _store()
    pool = HostExpertPool(store, torch.device("cpu"), threads=1, split=split)
    release = threading.Event()
    blocker = pool._pool.submit(release.wait)  # the worker is busy until released
    try:
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
        jobs = pool.submit_layer(0, [(1, x), (3, x[:1])], ACT)
        got = [j.result().raw for j in jobs]  # would block forever if the caller only waited
        assert not blocker.done()
        layout = store.layout.for_layer(0)
        assert torch.equal(got[0], layout.forward(x, store.expert(0, 1), ACT))
        assert torch.equal(got[1], layout.forward(x[:1], store.expert(0, 3), ACT))
    finally:
        release.set()
        pool.close()


def test_a_caller_that_only_waits_gets_the_same_outputs():
    store = _store()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for helps in (True, False):
        pool = HostExpertPool(store, torch.device("cpu"), threads=2, caller_helps=helps)
        try:
            jobs = pool.submit_layer(0, [(e, x) for e in range(3)], ACT)
            assert all((j.batch is not None) == helps for j in jobs)
            outs.append([j.result().raw for j in jobs])
        finally:
            pool.close()
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_expert_units_build_no_weight_views():
    """Split by experts, a job carries only the layout's forward (the views cost ~15 us an expert)."""
    store = _store()
    pool = HostExpertPool(store, torch.device("cpu"), threads=1, split=Split.EXPERTS)
    try:
        x = torch.randn(1, 64)
        assert pool._job(0, x, 0, ACT, rows=False).weights is None
        assert pool._job(0, x, 0, ACT, rows=True).weights is not None
    finally:
        pool.close()
