"""CudaTransferEngine on CPU over a fake with CUDA semantics (FIFO streams, events, no cancellation of
issued copies, delayed completion): the orderings hold and the bytes add up, across families x
predictors x modes x cache sizes x prefetch windows x multi-turn.

Checked per configuration: (A) compute reads a slot only after waiting on the event of the latest copy
into it, (B) every copy into a slot is ordered after the compute's last read of it, (C) copies into one
slot land in issue order; exact mode gives the tokens of the plain CPU engine; the bytes the engine
counts are the bytes the fake copied, and the per-step stats add up to the same number.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_cuda import FakeCudaBackend

from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.models.base import Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded, min_slots
from moespec.runtime.stats import StatsRecorder
from moespec.runtime.transfer import Ticket
from moespec.runtime.transfer.cuda import CudaTransferEngine

TURNS = ([3, 14, 15, 92, 65, 35], [89, 79, 32])  # the second turn extends the first conversation
NEW_TOKENS = 4


class ShiftedPredictor(NextLayerPredictor):
    """Predicts the true next-layer router's choice shifted by one expert id: mostly wrong, so
    prefetches get cancelled, wasted and superseded (deterministic)."""

    name = "shifted"

    def __init__(self, inner: NextLayerPredictor, num_experts: int) -> None:
        super().__init__(inner.adapter, list(inner.refs.values()))
        self.inner, self.num_experts = inner, num_experts

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        pred = self.inner.predict(layer, residual, used)
        if pred is None:
            return None
        return Routing((pred.ids + 1) % self.num_experts, pred.weights)


def _conversation(om) -> list[int]:
    engine, ids, out = Engine(om), [], []
    for turn in TURNS:
        ids = ids + list(turn)
        new = list(engine.generate(ids, SamplingConfig(max_new_tokens=NEW_TOKENS)))
        out += new
        ids = ids + new
    return out


def _load(folder, predictor: str, mode: ExecuteMode, extra_slots: int):
    from transformers import AutoConfig

    kind = Predictor.NONE if predictor == "none" else Predictor.ROUTER
    top_k = AutoConfig.from_pretrained(folder).num_experts_per_tok
    cfg = RuntimeConfig(cache_experts=min_slots(top_k, kind) + extra_slots, predictor=kind, execute=mode,
                        fetch_threshold=0.3)
    om = load_offloaded(folder, cfg, StatsRecorder())
    if predictor == "shifted":
        om.use_policy(dataclasses.replace(om.policy, predictor=ShiftedPredictor(om.policy.predictor,
                                                                                om.adapter.num_experts())))
    return om


def _install_fake(om, window: int, advance_p: float, seed: int) -> tuple[FakeCudaBackend, CudaTransferEngine]:
    om.cache.engine.close()
    fake = FakeCudaBackend(advance_p=advance_p, seed=seed)
    engine = CudaTransferEngine(torch.device("cpu"), om.cache.num_slots, window=window, backend=fake, pump=False)
    engine.set_timing(om.recorder.enabled)
    om.cache.engine = engine
    om.recorder.synchronize = engine.synchronize
    fake.slot_of = {om.cache.slots[s].data_ptr(): s for s in range(om.cache.num_slots)}
    row = om.cache.row

    def checked_row(slot: int) -> torch.Tensor:
        fake.read(slot)
        return row(slot)

    om.cache.row = checked_row
    return fake, engine


# (predictor, mode, slots above the minimum, prefetch window): every mode with both predictors, the
# cache sizes and windows alternating; "none" once (no prefetch at all).
CONFIGS = [("none", ExecuteMode.EXACT, 0, 2)] + [
    (pred, mode, *((0, 1), (3, 2))[i % 2])
    for i, (pred, mode) in enumerate((p, m) for p in ("router", "shifted") for m in ExecuteMode)
]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("predictor,mode,extra_slots,window", CONFIGS)
def test_orderings_and_bytes_with_cuda_semantics(tiny_models, family, predictor, mode, extra_slots, window):
    _check_orderings_and_bytes(tiny_models[family], family, predictor, mode, extra_slots, window)


@pytest.mark.parametrize("family", ["gpt_oss_mxfp4", "deepseek_v3"])
@pytest.mark.parametrize("mode", [ExecuteMode.EXACT, ExecuteMode.GUARDED])
def test_orderings_with_packed_rows_and_dense_first_layers(adapter_models, family, mode):
    """MXFP4 rows are bytes (poisoned with 0xFF, not NaN); DeepSeek-V3 has a dense first layer."""
    _check_orderings_and_bytes(adapter_models[family], family, "shifted", mode, 1, 1)


def _check_orderings_and_bytes(folder, family, predictor, mode, extra_slots, window):
    seed = hash((family, predictor, mode.value, extra_slots)) % 1000
    if mode == ExecuteMode.EXACT:  # the plain CPU engine's tokens are the reference
        ref = _load(folder, predictor, mode, extra_slots)
        try:
            want = _conversation(ref)
        finally:
            ref.close()
    om = _load(folder, predictor, mode, extra_slots)
    fake, engine = _install_fake(om, window, advance_p=0.3, seed=seed)
    try:
        got = _conversation(om)
        engine.synchronize()
        assert fake.violations == []
        assert fake.pending() == 0
        if mode == ExecuteMode.EXACT:
            assert got == want
        assert engine.bytes_moved == fake.bytes_copied
        counted = sum(s.total().h2d_bytes for s in om.recorder.steps)
        assert counted == fake.bytes_copied
        assert fake.copies_run * om.store.expert_bytes == fake.bytes_copied
    finally:
        om.close()


def _engine(num_slots: int = 4, window: int = 2):
    fake = FakeCudaBackend()
    eng = CudaTransferEngine(torch.device("cpu"), num_slots, window=window, backend=fake, pump=False)
    return fake, eng


def test_demand_copy_is_not_queued_behind_prefetches():
    fake, eng = _engine(num_slots=8, window=2)
    src = torch.arange(16.0)
    dst = torch.zeros(8, 16)
    pre = [eng.submit(dst[s], src + s, s, prefetch=True) for s in range(6)]
    demand = eng.submit(dst[7], src + 7, 7)
    assert sum(t.started for t in pre) == 2  # the window: the rest wait on the host
    eng.wait(demand)  # the compute stream needs slot 7 now
    assert torch.equal(dst[7], src + 7)
    assert fake.copies_run == 1  # only the demand copy ran: nothing queued ahead of it
    assert all(eng.cancel(t) for t in pre[2:])  # unreleased prefetches are truly cancelled
    assert not any(eng.cancel(t) for t in pre[:2])  # released ones run (CUDA cannot withdraw them)
    eng.synchronize()
    assert fake.copies_run == 3 and eng.bytes_moved == fake.bytes_copied == 3 * 16 * 4


def test_waiting_on_a_queued_prefetch_promotes_it():
    fake, eng = _engine(num_slots=4, window=1)
    src, dst = torch.arange(4.0), torch.zeros(4, 4)
    t0 = eng.submit(dst[0], src, 0, prefetch=True)
    t1 = eng.submit(dst[1], src + 1, 1, prefetch=True)
    assert t0.started and not t1.started and t1.done is None
    eng.wait(t1)
    assert t1.started and torch.equal(dst[1], src + 1)
    assert not eng.cancel(t1)


def test_a_copy_supersedes_a_queued_prefetch_into_the_same_slot():
    fake, eng = _engine(num_slots=2, window=1)
    src, dst = torch.arange(4.0), torch.zeros(2, 4)
    eng.submit(dst[0], src, 0, prefetch=True)  # released (window 1)
    stale = eng.submit(dst[1], src + 1, 1, prefetch=True)  # queued
    fresh = eng.submit(dst[1], src + 2, 1)  # the slot was taken for another expert
    assert stale.cancelled
    eng.wait(fresh)
    eng.synchronize()
    assert torch.equal(dst[1], src + 2) and eng.bytes_moved == fake.bytes_copied == 2 * 16


def test_events_are_reused_and_timing_only_while_recording():
    fake, eng = _engine(num_slots=2)
    src, dst = torch.arange(4.0), torch.zeros(2, 4)
    tickets = [eng.submit(dst[i % 2], src, i % 2) for i in range(6)]
    assert {id(t.done) for t in tickets} == {id(e) for e in eng._done}  # one done event per slot
    assert all(t.start is None for t in tickets) and eng.wait(tickets[-1]) is None
    eng.set_timing(True)
    t = eng.submit(dst[0], src, 0)
    span = eng.wait(t)
    eng.synchronize()
    assert t.start is not None and span is not None and span.ms() >= 0 and eng.busy_seconds() > 0
    assert eng._spans == []  # resolved and dropped at synchronize


def test_close_synchronizes_first():
    fake, eng = _engine(num_slots=2, window=1)
    src, dst = torch.arange(4.0), torch.zeros(2, 4)
    eng.submit(dst[0], src, 0, prefetch=True)
    eng.submit(dst[1], src + 1, 1, prefetch=True)
    eng.close()
    assert fake.pending() == 0 and torch.equal(dst[1], src + 1)


def test_pump_thread_releases_prefetches_without_host_calls():
    fake = FakeCudaBackend()
    eng = CudaTransferEngine(torch.device("cpu"), 6, window=2, backend=fake, pump=True)
    src, dst = torch.arange(4.0), torch.zeros(6, 4)
    tickets: list[Ticket] = [eng.submit(dst[s], src + s, s, prefetch=True) for s in range(6)]
    import time

    deadline = time.monotonic() + 10
    while not all(t.started for t in tickets) and time.monotonic() < deadline:
        time.sleep(0.001)  # the pump waits on each released copy, then releases the next
    assert all(t.started for t in tickets)
    eng.close()
    assert all(torch.equal(dst[s], src + s) for s in range(6))


def test_link_busy_time_counts_overlapping_copies_once():
    """busy_ms is the union of copy spans: two streams copying at once are one busy link, not two."""
    from fake_cuda import FakeEvent

    from moespec.runtime.transfer.cuda import busy_ms

    def ev(t):
        e = FakeEvent(timing=True)
        e.t = t
        return e

    elapsed = FakeCudaBackend().elapsed_ms
    # demand [2, 4] overlaps prefetch [1, 3]; [6, 7] stands alone; the first span need not be the earliest
    spans = [(ev(2.0), ev(4.0)), (ev(1.0), ev(3.0)), (ev(6.0), ev(7.0)), (ev(6.5), ev(6.75))]
    assert busy_ms(spans, elapsed) == 4.0  # the old sum of spans gave 5.25
    assert busy_ms([], elapsed) == 0.0
