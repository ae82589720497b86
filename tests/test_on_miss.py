"""`--on-miss host|auto`: exactness on every architecture and cache size, the host path against its
reference, byte accounting, the planner's choices on known costs, and the errors a user can cause."""

from __future__ import annotations

import pytest
import torch
from test_exactness import _incremental_logits
from tiny import GREEDY_PROMPT, offloaded_greedy, reference_greedy, reference_model
from typer.testing import CliRunner

from moespec.config import ExecuteMode, OnMiss, Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import OptionError
from moespec.runtime.engine import Engine
from moespec.runtime.layer.experts import weighted_contribution
from moespec.runtime.misses.host_pool import HostExpertPool
from moespec.runtime.misses.planner import Costs, MissPlanner
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

MODES = [OnMiss.HOST, OnMiss.AUTO]


def _check_exact(folder, on_miss: OnMiss, predictor: Predictor, slots_of) -> None:
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    k = ref.config.num_experts_per_tok
    for slots in slots_of(k):
        cfg = RuntimeConfig(cache_experts=slots, predictor=predictor, on_miss=on_miss)
        om = load_offloaded(folder, cfg, StatsRecorder())
        try:
            with torch.inference_mode():
                full = om.model(ids).logits
            inc = _incremental_logits(om, ids)
        finally:
            om.close()
        assert torch.allclose(full, want, atol=1e-5, rtol=0), (on_miss, slots, (full - want).abs().max())
        assert torch.allclose(inc, want, atol=1e-5, rtol=0), (on_miss, slots, (inc - want).abs().max())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("on_miss", MODES)
def test_exact_for_every_cache_size(tiny_models, family, on_miss):
    _check_exact(tiny_models[family], on_miss, Predictor.ROUTER, lambda k: sorted({2 * k, 2 * k + 1, 24}))


@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("on_miss", MODES)
def test_exact_on_adapter_families(adapter_models, family, on_miss):
    # gpt_oss_mxfp4: the host computes from the packed row (dequantised there by the layout).
    _check_exact(adapter_models[family], on_miss, Predictor.NONE, lambda k: sorted({k, 16}))


@pytest.mark.parametrize("on_miss", MODES)
def test_greedy_generation_matches_transformers(tiny_models, on_miss):
    folder = tiny_models["qwen3_moe"]
    cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.ROUTER, on_miss=on_miss)
    assert offloaded_greedy(folder, cfg, GREEDY_PROMPT, 10) == reference_greedy(folder, GREEDY_PROMPT, 10)


@pytest.mark.parametrize("execute", [ExecuteMode.SPECULATIVE])
def test_approximate_modes_run_the_same_experts(tiny_models, execute):
    """Speculative: which experts run is decided before the miss path, so host equals fetch.

    Guarded is not compared: its choice depends on what is resident, and a host-computed miss never
    enters the cache (the resident sets of fetch and host runs differ after the first miss), so the
    two runs may substitute different experts.
    """
    folder = tiny_models["mixtral"]
    prompt = [5, 17, 99, 3, 200, 41]
    out = {}
    for on_miss in (OnMiss.FETCH, OnMiss.HOST):
        cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.ROUTER, execute=execute, fetch_threshold=0.3,
                            on_miss=on_miss)
        rec = StatsRecorder()
        om = load_offloaded(folder, cfg, rec)
        try:
            toks = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=8)))
        finally:
            om.close()
        tot = [s.total() for s in rec.steps if s.kind == "decode"]
        out[on_miss] = (toks, [t.skipped for t in tot], [t.substituted for t in tot])
    assert out[OnMiss.FETCH] == out[OnMiss.HOST]


def test_host_path_equals_the_slow_reference(tiny_models):
    """One expert from its store row on the pool == the slow reference (weighted_contribution)."""
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=4))
    try:
        pool = HostExpertPool(om.store, om.device, threads=2)
        layer = om.store.moe_layers[1]
        block = om.model.model.layers[layer].mlp
        x = torch.randn(6, om.store.layout.hidden, generator=torch.Generator().manual_seed(0))
        routing = om.adapter.route(block, x)
        for e in sorted(set(routing.ids.flatten().tolist())):
            tok, raw, _ = weighted_contribution(x, routing, e, om.store.expert(layer, e), om.store.layout, block.act_fn)
            job = pool.submit(layer, e, x[tok], block.act_fn)
            got = job.result()
            assert torch.equal(got.raw, raw)
            assert job.d2h_bytes == job.h2d_bytes == len(tok) * x.shape[1] * 4
            assert got.tokens == len(tok)
        pool.close()
    finally:
        om.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_layer_batches_equal_one_job_per_expert(tiny_models, threads):
    """submit_layer (one batch, one future for the layer) == submit per expert, job for job, in order."""
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=4))
    try:
        pool = HostExpertPool(om.store, om.device, threads=threads)
        layer = om.store.moe_layers[0]
        act = om.model.model.layers[layer].mlp.act_fn
        gen = torch.Generator().manual_seed(1)
        items = [(e, torch.randn(t, om.store.layout.hidden, generator=gen)) for e, t in [(5, 1), (0, 3), (7, 2), (2, 1), (3, 4)]]
        jobs = pool.submit_layer(layer, items, act)
        assert [j.expert for j in jobs] == [5, 0, 7, 2, 3]
        assert len({id(j.future) for j in jobs}) == 1  # one dispatch for the layer
        for job, (e, x) in zip(jobs, items):
            one = pool.submit(layer, e, x, act).result()
            got = job.result()
            assert torch.equal(got.raw, one.raw) and got.tokens == x.shape[0]
            assert job.d2h_bytes == job.h2d_bytes == x.numel() * 4
        assert pool.submit_layer(layer, [], act) == []
        pool.close()
    finally:
        om.close()


def test_host_decode_moves_activations_not_experts(tiny_models):
    """Every miss on the host: no expert copy; per layer K x H x 4 bytes each way."""
    folder = tiny_models["qwen3_moe"]
    rec = StatsRecorder()
    om = load_offloaded(folder, RuntimeConfig(cache_experts=2, predictor=Predictor.NONE, on_miss=OnMiss.HOST), rec)
    try:
        moved = om.cache.engine.bytes_moved
        list(Engine(om).generate([5, 17, 99, 3], SamplingConfig(max_new_tokens=4)))
        assert om.cache.engine.bytes_moved == moved  # nothing copied after the load-time benchmark
    finally:
        om.close()
    k, h = om.adapter.top_k(), om.store.layout.hidden
    decode = [s for s in rec.steps if s.kind == "decode"]
    assert decode
    for step in decode:
        for st in step.layers.values():
            assert (st.host_computed, st.misses, st.hits, st.h2d_bytes) == (k, 0, 0, 0)
            assert st.d2h_bytes == st.host_h2d_bytes == k * h * 4
            assert st.host_ms > 0


def _planner(copy_ms: float, host_1: float, host_16: float, dev_1: float, dev_16: float, threads: int = 1):
    pool = type("Pool", (), {"threads": threads})()
    return MissPlanner(Costs(copy_ms, host_1, host_16, dev_1, dev_16), pool)


def test_planner_modes_and_costs():
    slow_link = _planner(copy_ms=10.0, host_1=1.0, host_16=4.0, dev_1=0.1, dev_16=0.2)
    misses = [(1, 1), (4, 1), (6, 1)]
    assert slow_link.plan(OnMiss.FETCH, [], [], misses, 0).host == frozenset()
    assert slow_link.plan(OnMiss.HOST, [(0, 1)], [], misses, 0).host == {1, 4, 6}
    # Decode on a slow link: every miss finishes sooner on the host (1, 2, 3 ms vs 10.1 ms and more).
    assert slow_link.plan(OnMiss.AUTO, [], [], misses, 0).host == {1, 4, 6}
    # Prefill chunk of 200 tokens with a fast link and a fast device: copying wins.
    fast_link = _planner(copy_ms=0.5, host_1=1.0, host_16=4.0, dev_1=0.1, dev_16=0.2)
    assert fast_link.plan(OnMiss.AUTO, [], [], [(2, 200), (3, 200)], 0).host == frozenset()
    # Balanced: each miss goes where it finishes first. Host 1 ms each, a fetch 2 ms + 0.1 ms on the device:
    # host 1, host 2, fetch 2.1 (host would be 3), host 3 (fetch 4.1), host 4 (fetch 4.1).
    mid = _planner(copy_ms=2.0, host_1=1.0, host_16=1.0, dev_1=0.1, dev_16=0.1)
    plan = mid.plan(OnMiss.AUTO, [], [], [(e, 1) for e in range(5)], 0)
    assert plan.host == {0, 1, 3, 4} and plan.device_ms == pytest.approx(2.1) and plan.host_ms == 4.0
    # Copies already queued ahead push a miss to the host.
    assert fast_link.plan(OnMiss.AUTO, [], [], [(2, 1)], 0).host == frozenset()
    assert fast_link.plan(OnMiss.AUTO, [], [], [(2, 1)], 10).host == {2}
    # An in-flight prefetch: wait for it when it lands soon, else compute it on the host.
    assert fast_link.plan(OnMiss.AUTO, [], [(5, 1)], [], 0).host == frozenset()
    assert slow_link.plan(OnMiss.AUTO, [], [(5, 1)], [], 4).host == {5}


def test_running_average_and_prefetch_budget():
    p = _planner(copy_ms=4.0, host_1=1.0, host_16=2.5, dev_1=0.1, dev_16=0.2)
    assert p.costs.host_ms(1) == 1.0 and p.costs.host_ms(16) == 2.5 and p.costs.host_ms(31) == 4.0
    for _ in range(50):
        p.costs.observe_host(1, 2.0)  # the host turned out twice as slow
    assert p.costs.host_ms(1) == pytest.approx(2.0, rel=1e-3)
    assert p.costs.device_ms(1) == 0.1  # a separate device keeps its own speed
    p.costs.shared = True  # CPU: the same processor got slower for both
    assert p.costs.device_ms(1) == pytest.approx(0.2, rel=1e-3)
    assert p.prefetch_budget(0) == 1  # no layer time yet
    p.layer_ms = 10.0
    assert p.prefetch_budget(0) == 2 and p.prefetch_budget(1) == 1 and p.prefetch_budget(5) == 0


def test_running_average_ignores_one_preempted_job():
    p = _planner(copy_ms=4.0, host_1=1.0, host_16=2.5, dev_1=0.1, dev_16=0.2)
    p.costs.observe_host(1, 60.0)  # one job the OS preempted: 60x its benchmark
    assert p.costs.host_scale == pytest.approx(4**0.2)  # moves by the clamped step only (x1.32)
    for _ in range(30):
        p.costs.observe_host(1, 10.0)  # the host really is 10x slower: followed within 30 jobs
    assert p.costs.host_ms(1) == pytest.approx(10.0, rel=0.01)


def test_idle_link_admits_one_prefetch_that_outlasts_a_layer():
    p = _planner(copy_ms=10.0, host_1=1.0, host_16=2.5, dev_1=0.1, dev_16=0.2)
    p.layer_ms = 3.0  # a copy takes 3 layers: none would land in time
    assert p.prefetch_budget(0) == 1 and p.prefetch_budget(1) == 0
    assert p.prefetch_budget(2) == 0


def test_prediction_runs_only_where_it_pays():
    # Default model on CPU: ~0.8 used prefetches per layer x 0.25 ms of host work they may save, against
    # 0.4 ms of prediction and prefetch bookkeeping: skipped, but one layer in 64 still predicts (probe).
    p = _planner(copy_ms=2.6, host_1=0.25, host_16=0.3, dev_1=0.25, dev_16=0.3)
    assert p.prefetch_pays()  # nothing measured yet: predict (and measure)
    p.observe_predict(0.4)
    assert p.prefetch_pays()  # usefulness not measured yet
    p.observe_used(1)
    p.observe_used(0)  # running average: 1 + 0.2 * (0 - 1)
    assert p.used_per_layer == pytest.approx(0.8)
    decisions = [p.prefetch_pays() for _ in range(128)]
    assert decisions.count(True) == 2 and decisions[63] and decisions[127]
    # A 30B expert computed on the CPU (2 ms) beside a GPU predictor (0.1 ms): every layer predicts.
    gpu = _planner(copy_ms=2.0, host_1=2.0, host_16=6.0, dev_1=0.05, dev_16=0.06)
    gpu.observe_predict(0.1)
    gpu.observe_used(1)
    assert all(gpu.prefetch_pays() for _ in range(64))
    # One preempted layer (40 ms) moves the overhead by the clamped step only: 0.1 + 0.2 * (0.4 - 0.1).
    gpu.observe_predict(40.0)
    assert gpu.predict_ms == pytest.approx(0.16)


@pytest.mark.parametrize("pays", [False, True])
def test_auto_skips_the_predictor_where_it_does_not_pay(tiny_models, pays):
    """Scripted averages: prediction costs 100 ms per layer and saves nothing -> no prediction, no
    prefetch copy, no recall counted (the first probe comes after 64 layers); free and useful -> every
    decode layer predicts. Greedy tokens equal transformers either way."""
    folder = tiny_models["qwen3_moe"]
    cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.ROUTER, on_miss=OnMiss.AUTO)
    rec = StatsRecorder()
    om = load_offloaded(folder, cfg, rec)
    try:
        om.planner.predict_ms, om.planner.used_per_layer = (1e-9, 4.0) if pays else (100.0, 0.0)
        om.planner.observe_predict = lambda ms: None  # keep the scripted averages
        om.planner.observe_used = lambda used: None
        toks = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=6)))
    finally:
        om.close()
    assert toks == reference_greedy(folder, GREEDY_PROMPT, 6)
    decode = [s.total() for s in rec.steps if s.kind == "decode"]
    assert len(decode) * len(om.store.moe_layers) < 64  # no probe layer in this run
    recall_total = sum(t.recall_total for t in decode)
    prefetched = sum(t.prefetched + t.prefetch_cancelled for t in decode)
    if pays:
        assert recall_total == (len(om.store.moe_layers) - 1) * len(decode) * om.adapter.top_k()
    else:
        assert recall_total == 0 and prefetched == 0


def test_shared_processor_sends_landed_experts_where_they_finish_first():
    # CPU: host and device are the same cores. Benchmarked alike (0.3 ms), the two landed experts run on
    # the main thread (0.6 ms) beside the pool's two misses (0.6 ms): moving one would take 0.9 ms.
    p = _planner(copy_ms=2.6, host_1=0.3, host_16=0.4, dev_1=0.3, dev_16=0.4)
    p.costs.shared = True
    landed, misses = [(0, 1), (1, 1)], [(2, 1), (3, 1)]
    assert p.plan(OnMiss.AUTO, landed, [], misses, 0).host == {2, 3}
    # Observed beside the pool the main thread takes 0.9 ms per expert: the last landed one moves to the
    # pool (device 0.9, pool 0.9 ms, against 1.8 / 0.6); moving the other too would take the pool 1.2 ms.
    for _ in range(20):
        p.costs.observe_device(1, 0.9)
    assert p.costs.device_ms(1) == pytest.approx(0.9, rel=0.02)
    plan = p.plan(OnMiss.AUTO, landed, [], misses, 0)
    assert plan.host == {1, 2, 3} and plan.device_ms == pytest.approx(0.9, rel=0.02)
    assert plan.host_ms == pytest.approx(0.9)
    # A separate device (CUDA) always computes what it holds.
    q = _planner(copy_ms=2.6, host_1=0.3, host_16=0.4, dev_1=5.0, dev_16=5.0)
    assert q.plan(OnMiss.AUTO, landed, [], misses, 0).host == {2, 3}


def test_planner_in_flight_lands_by_its_age():
    slow = _planner(copy_ms=10.0, host_1=1.0, host_16=4.0, dev_1=0.1, dev_16=0.2)
    # Issued 9.5 ms ago: lands in 0.5 ms, waiting (0.6 ms) beats the host (1 ms); just issued: host.
    assert slow.plan(OnMiss.AUTO, [], [(5, 1)], [], 0, {5: 9.5}).host == frozenset()
    assert slow.plan(OnMiss.AUTO, [], [(5, 1)], [], 0, {5: 0.0}).host == {5}
    # Two in flight: the older (landed at 0.5 ms) is waited for, the newer is behind it (10.5 ms): host.
    plan = slow.plan(OnMiss.AUTO, [], [(5, 1), (6, 1)], [], 0, {5: 9.5, 6: 9.0})
    assert plan.host == {6} and plan.device_ms == pytest.approx(0.6) and plan.host_ms == 1.0


def test_planner_on_measured_cpu_costs():
    # Costs measured on the default model (2-core CPU, 0.9 GB/s link): host and device are the same
    # processor, so decode computes every miss on the host (no copy), while a prefill layer of 16 chunks
    # is split: the device computes what the link delivers while the host worker computes the rest.
    cpu = _planner(copy_ms=0.99, host_1=0.083, host_16=0.21, dev_1=0.168, dev_16=0.266)
    assert cpu.plan(OnMiss.AUTO, [], [], [(e, 1) for e in range(4)], 0).host == {0, 1, 2, 3}
    for t in (16, 64):
        plan = cpu.plan(OnMiss.AUTO, [], [], [(e, t) for e in range(16)], 0)
        fetched = 16 - len(plan.host)
        assert fetched >= 2
        all_host = 16 * cpu.costs.host_ms(t)
        all_fetch = 16 * cpu.costs.copy_ms + cpu.costs.device_ms(t)  # the link is the bottleneck
        assert max(plan.device_ms, plan.host_ms) < min(all_host, all_fetch)


def test_bad_host_threads_and_on_miss():
    with pytest.raises(OptionError, match="--host-threads 0"):
        RuntimeConfig(host_threads=0)
    from moespec.cli.runtime_opts import build_runtime_config

    with pytest.raises(OptionError, match="--on-miss 'gpu'"):
        build_runtime_config(device="cpu", dtype="auto", gpu_memory=None, cache_experts=4, predictor=Predictor.NONE,
                             execute=ExecuteMode.EXACT, fetch_threshold=0.0, link_gbps=None, on_miss="gpu")


def test_host_that_cannot_run_the_experts_is_a_typed_error(tiny_models, monkeypatch):
    import moespec.runtime.misses.planner as mp

    def refuse(*args):
        raise NotImplementedError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(mp, "host_forward", refuse)
    with pytest.raises(OptionError, match="--on-miss") as err:
        load_offloaded(tiny_models["olmoe"], RuntimeConfig(cache_experts=4, on_miss=OnMiss.HOST))
    assert "--on-miss fetch" in err.value.hint


def test_cli_errors_are_one_line(tiny_models, monkeypatch):
    from moespec.cli.app import app

    res = CliRunner().invoke(app, ["chat", str(tiny_models["olmoe"]), "--host-threads", "0", "--prompt", "hi",
                                   "--device", "cpu"])
    assert res.exit_code == 2 and "--host-threads 0 must be at least 1" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["profile", str(tiny_models["olmoe"]), "--on-miss", "fetch,gpu"])
    assert res.exit_code == 2 and "--on-miss 'gpu' is not valid" in res.output


def test_strategy_names():
    from moespec.profile.strategy import parse_on_miss_list, parse_strategies

    arms = parse_strategies("none,router+host,oracle", parse_on_miss_list("fetch,auto"))
    assert [a.name for a in arms] == ["none", "none+auto", "router+host", "oracle", "oracle+auto"]
    assert arms[2].predictor == Predictor.ROUTER and arms[2].on_miss == OnMiss.HOST
    with pytest.raises(OptionError, match="--strategies 'gpu'"):
        parse_strategies("router+gpu")
