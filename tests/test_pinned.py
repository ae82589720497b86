"""Host memory: the RAM check runs before anything is allocated or pinned; pinned stores have exactly
their size (registered with the CUDA runtime, faked here); the recorder is wired at load."""

from __future__ import annotations

import contextlib
import mmap

import pytest
import torch

from moespec.config import Predictor, RuntimeConfig
from moespec.errors import BudgetError
from moespec.models.base import ExpertLayout
from moespec.runtime.host import memory as host_memory, store as store_mod
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import NullRecorder, StatsRecorder
from moespec.runtime.host.store import ExpertStore


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls (the CUDA runtime's, on a CPU machine)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]
        return 0


@pytest.fixture
def fake_cudart(monkeypatch):
    rt = FakeCudart()
    devices = []

    @contextlib.contextmanager
    def device(dev):
        devices.append(dev)
        yield

    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "device", device)
    rt.devices = devices
    return rt


def test_pinned_store_is_exactly_its_size_and_registered_on_the_asked_device(fake_cudart):
    layout = ExpertLayout(hidden=48, intermediate=40)  # 3*48*40 = 5760 elements per expert
    want = 3 * 7 * layout.numel * 2  # 3 layers x 7 experts x bf16
    assert ExpertStore.bytes_needed(3, 7, layout, torch.bfloat16) == want
    st = ExpertStore([0, 2, 4], 7, layout, torch.bfloat16, pin=True, device=torch.device("cuda", 1))
    ptr = st.buffer.data_ptr()
    assert fake_cudart.registered == {ptr: want}  # not the next power of two (131072)
    assert ptr % mmap.PAGESIZE == 0
    assert fake_cudart.devices == [torch.device("cuda", 1)]
    assert st.total_bytes == want and st.buffer.dtype == torch.bfloat16 and st.buffer.shape == (3, 7, layout.numel)
    st.expert(2, 3).fill_(1.5)  # the memory is usable
    assert float(st.buffer[1, 3].sum()) == 1.5 * layout.numel
    st.close()
    assert fake_cudart.registered == {} and fake_cudart.devices[-1] == torch.device("cuda", 1)


def test_too_little_host_ram_is_one_line_before_anything_is_allocated(tiny_models, monkeypatch):
    allocated = []
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 100 * 2**20)  # below the headroom + store
    real_init = store_mod.ExpertStore.__init__

    def spy(self, *a, **kw):
        allocated.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(store_mod.ExpertStore, "__init__", spy)
    with pytest.raises(BudgetError) as err:
        load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=4))
    assert allocated == []
    assert "\n" not in err.value.message and "GiB of host RAM" in err.value.message
    assert "0.1 GiB is available" in err.value.message


def test_host_ram_check_counts_the_store(tiny_models, monkeypatch):
    seen = []
    monkeypatch.setattr(host_memory, "check_host_memory", lambda need, what: seen.append(need))
    from moespec.runtime import load as offload

    monkeypatch.setattr(offload, "check_host_memory", lambda need, what: seen.append(need))
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=4))
    try:
        assert om.store.total_bytes < seen[0]  # the store + the dense weights (they stay on the CPU)
        dense = sum(p.numel() * p.element_size() for p in om.model.parameters())
        assert seen[0] == om.store.total_bytes + dense
    finally:
        om.close()


def test_load_wires_the_recorder_and_timing(tiny_models):
    rec = StatsRecorder()
    om = load_offloaded(tiny_models["mixtral"], RuntimeConfig(cache_experts=4, predictor=Predictor.ROUTER), rec)
    try:
        eng = om.cache.engine
        assert rec.synchronize == eng.synchronize
        om.set_recorder(NullRecorder())
        rec2 = StatsRecorder()
        om.set_recorder(rec2)
        assert rec2.synchronize == eng.synchronize
    finally:
        om.close()


def test_cuda_device_is_always_indexed_and_checked(monkeypatch):
    from moespec.errors import DeviceError
    from moespec.runtime.load import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="cuda:2 does not exist"):
        resolve_device("cuda:2")


def test_cpu_engine_copy_supersedes_a_queued_prefetch_and_close_synchronizes():
    from moespec.runtime.transfer import ThreadTransferEngine

    eng = ThreadTransferEngine(link_gbps=1e-4)  # 20 kB take 0.2 s: the worker stays busy meanwhile
    slow = eng.submit(torch.zeros(5000), torch.ones(5000), 0)
    dst = torch.zeros(4)
    stale = eng.submit(dst, torch.full((4,), 1.0), 1, prefetch=True)
    fresh = eng.submit(dst, torch.full((4,), 2.0), 1)  # would run before the prefetch (priority)
    eng.close()  # finishes every copy first
    assert stale.cancelled and not fresh.cancelled and slow.done.is_set() and fresh.done.is_set()
    assert dst.tolist() == [2.0] * 4 and eng.bytes_moved == 20000 + 16
