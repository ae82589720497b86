"""Running strategies on one trace: cold start, warm-up, interleaved repeats, per-step records.

For each prompt length: the `exact` run records the trace (trace.py); every strategy then runs
one untimed warm-up (prefill + a few decode steps); then ``repeats`` rounds run every strategy
once each, interleaved (none, router, ..., none, router, ...) so slow drift of the machine hits
all strategies alike. Every run starts cold (empty KV cache and expert cache; with the experts on
disk, the store file's page cache dropped too: runtime/host/page_cache.py). Clocks are read only
after the device was synchronised (the recorder does it at the end of each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from moespec.config import ExecuteMode, Predictor
from moespec.predict.base import NextLayerPredictor, NoPredictor
from moespec.predict.oracle import OraclePredictor
from moespec.profile.bounds import StepBounds, step_bounds
from moespec.profile.copy_share import CopyShare, set_share, unthrottle
from moespec.profile.probes import CopyLog, LayerTimer, installed
from moespec.profile.strategy import Strategy
from moespec.profile.trace import (DecodeInputs, TokenTrace, cold_start, load_text, prompt_tokens, record_trace,
                                   token_sha256)
from moespec.runtime.engine import Engine
from moespec.runtime.stats import LayerStats, StatsRecorder
from moespec.runtime.transfer import Span


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile.

    Attributes:
        strategies: predictor + on-miss arms to compare (ORACLE replays the exact run's routing).
        prompt_lens: prompt lengths P, one trace each.
        gen: N decode steps per run (teacher-forced).
        repeats: timed runs per strategy and prompt length.
        warmup_steps: decode steps of the untimed warm-up run.
        execute: execution mode of every strategy run.
        data: text file for the prompt (None = shipped text).
        seed: seed for prompt ids when the model has no tokenizer.
        timeline: record a timeline of one decode step per strategy (``--trace``).
        decode_inputs: what the decode steps are teacher-forced on (trace.py).
        copy_share: ``--copy-share``: an unthrottled on-demand probe sets the emulated link so copies
            are this share of on-demand TPOT (copy_share.py); None: the link as loaded.
    """

    strategies: tuple[Strategy, ...]
    prompt_lens: tuple[int, ...]
    gen: int = 32
    repeats: int = 3
    warmup_steps: int = 2
    execute: ExecuteMode = ExecuteMode.EXACT
    data: str | None = None
    seed: int = 0
    timeline: bool = False
    decode_inputs: DecodeInputs = DecodeInputs.GREEDY
    copy_share: float | None = None


@dataclass
class StepRecord:
    """One timed decode step.

    Attributes:
        wall_ms: step wall time.
        layers: MoE layer -> its LayerStats.
        layer_ms: decoder layer -> wall time.
        copy_busy_ms, copy_bytes: link time and bytes of the copies of this step.
        top1: the next-token prediction equals the exact run's.
        kl: KL(exact || strategy) of the final logits, nats.
        bounds: on-demand / floor times.
        nll: -log p(target) of the step's logits, nats (the trace's target: perplexity = exp(mean nll)).
        disk_bytes: bytes this process had read from disk during the step (/proc/self/io; the mmap
            baseline's page faults and read-around included); None off the disk tier or uncounted.
    """

    wall_ms: float
    layers: dict[int, LayerStats]
    layer_ms: dict[int, float]
    copy_busy_ms: float
    copy_bytes: int
    top1: bool
    kl: float
    bounds: StepBounds
    nll: float = 0.0
    disk_bytes: int | None = None


@dataclass
class RunRecord:
    """One timed run of one strategy on one trace."""

    strategy: str
    prompt_len: int
    repeat: int
    ttft_ms: float
    steps: list[StepRecord]
    token_sha256: str
    prefill: LayerStats | None = None  # the prefill step summed over layers (where its experts ran)
    gate: list[dict] | None = None  # the prediction gate per source layer at the run's end (gate.py)


@dataclass
class Timeline:
    """One decode step on a common clock, in ms from the step's start.

    Attributes:
        layers: (decoder layer, start_ms, dur_ms).
        inner: (decoder layer, "stall" | "experts", start_ms, dur_ms) inside the MoE block.
        host: (decoder layer, start_ms, dur_ms) of each expert computed on the host (``--on-miss``).
        copies: (layer, expert, "demand" | "prefetch", start_ms, dur_ms, nbytes).
        copy_lane: the copies' lane name: "copy (H2D)", or "disk read" with the experts on disk.
    """

    strategy: str
    prompt_len: int
    step: int
    wall_ms: float
    layers: list[tuple[int, float, float]] = field(default_factory=list)
    inner: list[tuple[int, str, float, float]] = field(default_factory=list)
    copies: list[tuple[int, int, str, float, float, int]] = field(default_factory=list)
    host: list[tuple[int, float, float]] = field(default_factory=list)
    copy_lane: str = "copy (H2D)"


@dataclass(frozen=True)
class LinkMeasurement:
    """The experts' link bandwidth measured once per profile (expert-sized copies): host to device, or,
    with the experts on disk, disk to RAM (``over == "disk"``: O_DIRECT reads, ``copies`` in flight)."""

    gbps: float
    emulated_gbps: float | None
    pinned: bool
    copies: int
    bytes_per_copy: int
    over: str = "host to device"
    o_direct: bool = False


@dataclass
class ProfileRun:
    """Everything measured: the link, the traces (by prompt length) and the timed runs."""

    link: LinkMeasurement
    traces: dict[int, TokenTrace]
    runs: list[RunRecord]
    timelines: list[Timeline]
    copy_share: CopyShare | None = None
    page_cache: str | None = None  # disk tier: "dropped" (root) or "store file" (only its pages) before each run


class _SpanKeepingRecorder(StatsRecorder):
    """A StatsRecorder that also keeps the raw spans of one chosen step (for the timeline)."""

    def __init__(self, synchronize) -> None:
        super().__init__(synchronize)
        self.keep = False
        self.kept: list[tuple[int, str, Span]] = []
        self._layer_of: dict[int, int] = {}

    def layer(self, layer: int) -> LayerStats:
        stats = super().layer(layer)
        self._layer_of[id(stats)] = layer
        return stats

    def span(self, stats: LayerStats, name: str, span: Span | None) -> None:
        super().span(stats, name, span)
        if self.keep and span is not None:
            self.kept.append((self._layer_of.get(id(stats), -1), name, span))


def measure_link(om, copies: int = 8) -> LinkMeasurement:
    """Copy ``copies`` experts into scratch device buffers through the runtime's transfer engine.

    With the experts on disk (runtime.transfer.disk.DiskReadEngine) the link is the disk: ``copies``
    rows spread over the file are read with all of them in flight into the store's own aligned scratch
    rows (O_DIRECT needs page-aligned buffers a stride long), the GB/s the disk floor divides by;
    otherwise one expert after another into one scratch slot (the engines copy one at a time).
    """
    from moespec.runtime.host.disk_store import DiskStore

    eng = om.cache.engine
    eng.set_timing(True)  # busy_seconds needs timed copies (CUDA times copies only while asked to)
    store = om.store
    disk = isinstance(store, DiskStore)
    n = min(copies, store.num_experts)
    layer = store.moe_layers[0]
    if disk:
        scratch = store.slot_rows(n, om.device)  # [n, P], page-aligned
        where = [(store.moe_layers[i % len(store.moe_layers)], (7 * i + 3) % store.num_experts) for i in range(n)]
        dst = [(scratch[i], -1 - i) for i in range(n)]  # slot ids no cache slot has
    else:
        scratch = torch.empty_like(om.cache.slots[0])  # [P]
        where, dst = [(layer, e) for e in range(n)], [(scratch, 0)] * n
    eng.submit(dst[0][0], store.expert(layer, 0), dst[0][1])  # first copy pays one-time costs: untimed
    eng.synchronize()
    busy0 = eng.busy_seconds()
    for (buf, slot), (lay, e) in zip(dst, where):
        eng.submit(buf, store.expert(lay, e), slot)
    eng.synchronize()
    busy = eng.busy_seconds() - busy0
    gbps = n * store.expert_bytes / busy / 1e9 if busy > 0 else float("inf")
    return LinkMeasurement(gbps=gbps, emulated_gbps=getattr(eng, "link_gbps", None), pinned=store.pinned,
                           copies=n, bytes_per_copy=store.expert_bytes, over="disk" if disk else "host to device",
                           o_direct=bool(getattr(eng, "direct", False)))


def on_disk(om) -> bool:
    """The experts' rows come from the store file: read with O_DIRECT, or mapped (the mmap baseline)."""
    from moespec.runtime.host.disk_store import DiskStore

    return isinstance(om.store, DiskStore) or getattr(om.store, "mapping", None) is not None


def drop_page_cache(om) -> bool:
    """Drop the store file's page cache before a run (page_cache.drop); True when the whole cache was
    dropped (root)."""
    from moespec.runtime.host import page_cache

    store = om.store
    return page_cache.drop(getattr(store, "file", None) or store.path, getattr(store, "mapping", None))


def _vs_reference(ref_logits: torch.Tensor, logits: torch.Tensor, target: int) -> tuple[bool, float, float]:
    """One decode step's logits [V] against the exact run's [V]: (same top-1, KL(ref || run) in nats,
    -log p(target) in nats); one float64 log_softmax of each."""
    p_log = torch.log_softmax(ref_logits.double().cpu(), dim=-1)
    q_log = torch.log_softmax(logits.double().cpu(), dim=-1)
    top1 = int(torch.argmax(q_log)) == int(torch.argmax(p_log))
    return top1, float((p_log.exp() * (p_log - q_log)).sum()), float(-q_log[target])


def _timeline(strategy: str, prompt_len: int, step: int, wall_ms: float, ref, spans, kept, copies) -> Timeline:
    tl = Timeline(strategy, prompt_len, step, wall_ms)
    at = lambda t: Span(ref, t).ms()  # noqa: E731 - ms from the step's start
    tl.layers = [(layer, at(s.start), s.ms()) for layer, s in spans]
    names = {"stall_ms": "stall", "compute_ms": "experts"}
    tl.inner = [(layer, names.get(name, name), at(s.start), s.ms()) for layer, name, s in kept if name != "host_ms"]
    if isinstance(ref, float):  # host spans are perf_counter times: comparable with a CPU step clock only
        tl.host = [(layer, at(s.start), s.ms()) for layer, name, s in kept if name == "host_ms"]
    tl.copies = [(c.layer, c.expert, c.kind, at(c.ticket.start), Span(c.ticket.start, c.ticket.end).ms(),
                  c.ticket.nbytes) for c in copies if c.ticket.start is not None]
    return tl


def _run(om, engine, trace: TokenTrace, arm: Strategy, predictor: NextLayerPredictor, cfg: ProfileConfig,
         timer: LayerTimer, log: CopyLog, link_gbps: float, n_steps: int, repeat: int,
         timeline_step: int | None) -> tuple[RunRecord, Timeline | None]:
    from moespec.runtime.host.page_cache import read_bytes

    strategy = arm.name
    rec = _SpanKeepingRecorder(synchronize=log.synchronize)
    disk = on_disk(om)
    if disk:  # a cold start for the page cache too (the mmap baseline's cache)
        drop_page_cache(om)
    # An arm without its own τ keeps the one in force (the loaded --fetch-threshold, or the last arm's).
    threshold = om.policy.fetch_threshold if arm.threshold is None else arm.threshold
    cold_start(om, engine, replace(om.policy, predictor=predictor, execute=arm.execute or cfg.execute,
                                   on_miss=arm.on_miss, fetch_threshold=threshold))
    om.set_recorder(rec)
    expert_bytes = om.store.expert_bytes
    engine.forward(trace.prompt, "prefill")
    ttft = rec.steps[-1].wall_ms
    prefill = rec.steps[-1].total()
    timer.take()
    log.take()
    steps, timeline = [], None
    for i in range(n_steps):
        if isinstance(predictor, OraclePredictor):
            predictor.step = i
        rec.keep = i == timeline_step
        busy0, bytes0 = log.busy_seconds(), log.bytes_moved
        ref = log.mark()
        io0 = read_bytes() if disk else None
        logits = engine.forward([trace.decode[i]], "decode")  # [V]; end_step synchronised
        io1 = read_bytes() if io0 is not None else None
        st = rec.steps[-1]
        spans, copies = timer.take(), log.take()
        layer_ms = {layer: s.ms() for layer, s in spans}
        bounds = step_bounds(
            st.wall_ms, layer_ms, {layer: s.stall_ms for layer, s in st.layers.items()},
            {layer: s.misses + s.prefetch_used for layer, s in st.layers.items()}, expert_bytes, link_gbps)
        top1, kl, nll = _vs_reference(trace.logits[i], logits, trace.targets[i])
        steps.append(StepRecord(
            wall_ms=st.wall_ms, layers=st.layers, layer_ms=layer_ms,
            copy_busy_ms=(log.busy_seconds() - busy0) * 1e3, copy_bytes=log.bytes_moved - bytes0,
            top1=top1, kl=kl, bounds=bounds, nll=nll, disk_bytes=None if io1 is None else io1 - io0))
        if rec.keep:
            timeline = _timeline(strategy, len(trace.prompt), i, st.wall_ms, ref, spans, rec.kept, copies)
            if getattr(om.cache.engine, "direct", None) is not None:  # the disk reader (transfer/disk.py)
                timeline.copy_lane = "disk read (O_DIRECT)" if om.cache.engine.direct else "disk read (buffered)"
            elif disk:  # the mmap baseline: rows copied out of the mapping, page faults on first touch
                timeline.copy_lane = "disk read (page cache)"
            rec.keep = False
    sha = token_sha256(trace.prompt, trace.decode[:n_steps])
    gate = getattr(om.runner.prefetcher, "gate", None)
    gated = None if gate is None else [{"layer": layer, **g} for layer, g in gate.report().items()]
    return RunRecord(strategy, len(trace.prompt), repeat, ttft, steps, sha, prefill, gated), timeline


def run_profile(om, tokenizer, cfg: ProfileConfig, predictors: dict[str, NextLayerPredictor],
                progress: Callable[[str], None] = lambda msg: None,
                reuse: dict[int, TokenTrace] | None = None) -> ProfileRun:
    """Profile ``cfg.strategies`` on ``om``; ``predictors`` maps a strategy name to its predictor (oracle
    strategies are built here from each trace).

    ``reuse``: the traces (by prompt length) of an earlier profile of the same model, run on instead
    of recording them again (the mmap baseline's second load: same reference, same tokens).

    Raises:
        DataError, PromptError: unreadable --data, prompt beyond the context.
    """
    engine = Engine(om)
    page = None if not on_disk(om) else "dropped" if drop_page_cache(om) else "store file"
    link = measure_link(om)
    progress(f"link: {link.gbps:.3g} GB/s measured ({link.copies} copies of {link.bytes_per_copy / 1e6:.2f} MB)")
    text, source = load_text(cfg.data)
    refs = om.layer_refs()
    arms = cfg.strategies
    traces, runs, timelines = {}, [], []
    share = None
    saved_policy, saved_recorder = om.policy, om.recorder
    with installed(om) as (timer, log):
        try:
            for plen in cfg.prompt_lens:
                vocab = int(om.config.get_text_config().vocab_size)
                forced = None
                if cfg.decode_inputs == DecodeInputs.TEXT:  # the text goes on after the prompt: gen + 1 more ids
                    ids = prompt_tokens(tokenizer, text, plen + cfg.gen + 1, vocab, cfg.seed)
                    prompt, forced = ids[:plen], ids[plen:]
                else:
                    prompt = prompt_tokens(tokenizer, text, plen, vocab, cfg.seed)
                if reuse is not None and plen in reuse:
                    trace = reuse[plen]
                else:
                    progress(f"prompt {plen}: exact run (records the trace)")
                    trace = record_trace(om, engine, prompt, cfg.gen, source, forced)
                traces[plen] = trace
                if cfg.copy_share is not None and share is None:  # once, on the first prompt's trace
                    progress(f"prompt {plen}: on-demand probe with unthrottled copies (--copy-share)")
                    unthrottle(om)
                    for _ in range(2):  # the second: after the first run's one-time costs
                        probe, _ = _run(om, engine, trace, Strategy(Predictor.NONE), NoPredictor(om.adapter, refs),
                                        cfg, timer, log, link.gbps, cfg.gen, -1, None)
                    share = set_share(om, cfg.copy_share, probe.steps)
                    link = measure_link(om)
                    progress(f"link set to {share.link_gbps:.3g} GB/s: on-demand TPOT {share.probe_tpot_ms:.1f} ms "
                             f"unthrottled, {share.bytes_per_token / 1e6:.2f} MB/token")
                preds = dict(predictors)
                if any(a.predictor == Predictor.ORACLE for a in arms):
                    oracle = OraclePredictor(om.adapter, refs, trace.routings)
                    preds.update({a.name: oracle for a in arms if a.predictor == Predictor.ORACLE})
                for arm in arms:
                    progress(f"prompt {plen}: warm-up {arm.name}")
                    _run(om, engine, trace, arm, preds[arm.name], cfg, timer, log, link.gbps,
                         min(cfg.warmup_steps, cfg.gen), -1, None)
                for r in range(cfg.repeats):
                    for arm in arms:
                        progress(f"prompt {plen}: {arm.name} repeat {r + 1}/{cfg.repeats}")
                        want = cfg.timeline and plen == cfg.prompt_lens[0] and r == cfg.repeats - 1
                        run, tl = _run(om, engine, trace, arm, preds[arm.name], cfg, timer, log, link.gbps,
                                       cfg.gen, r, cfg.gen // 2 if want else None)
                        runs.append(run)
                        if tl is not None:
                            timelines.append(tl)
        finally:
            om.reset_step()
            om.use_policy(saved_policy)
            om.set_recorder(saved_recorder)
    return ProfileRun(link=link, traces=traces, runs=runs, timelines=timelines, copy_share=share, page_cache=page)
