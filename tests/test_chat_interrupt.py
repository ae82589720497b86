"""Ctrl-C during an answer: queued copies cancelled, pins released, caches consistent, and the next
turn equals a fresh session's (and transformers). The interrupt is raised deterministically from
the runner's observer hook at a chosen expert of a chosen forward, on a slow emulated link.
"""

from __future__ import annotations

import pytest
import torch
from tiny import reference_model

from moespec.chat.render import render
from moespec.chat.session import ChatSession
from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder
from moespec.runtime.transfer import ThreadTransferEngine

SYSTEM = "You are brief."


class InterruptAt:
    """Runner observer: raises KeyboardInterrupt after the ``n``-th expert output of ``layer``."""

    def __init__(self, layer: int, n: int) -> None:
        self.layer, self.n, self.seen = layer, n, 0

    def routing(self, layer, x, residual, routing) -> None:
        pass

    def expert_output(self, layer, expert, tok, raw) -> None:
        if layer == self.layer:
            self.seen += 1
            if self.seen == self.n:
                raise KeyboardInterrupt


def _session(folder, link_gbps=None, slots=5):
    from transformers import AutoTokenizer

    om = load_offloaded(folder, RuntimeConfig(cache_experts=slots, predictor=Predictor.ROUTER, link_gbps=link_gbps),
                        StatsRecorder())
    return ChatSession(Engine(om), AutoTokenizer.from_pretrained(folder), SamplingConfig(max_new_tokens=6),
                       system=SYSTEM)


def _assert_consistent(session) -> None:
    om, engine = session.engine.om, session.engine
    cache = om.cache
    assert cache.evictable() == cache.num_slots  # no pin left
    assert om.ledger.held() == {} and om.runner.prefetcher.predicted == {}
    for slot in range(cache.num_slots):  # every slot that claims an expert holds exactly its bytes
        key = cache.key_of(slot)
        if key is not None:
            assert torch.equal(cache.row(slot), om.store.expert(*key)), (slot, key)
    if engine._kv is not None:
        assert all(layer.get_seq_length() == len(engine.cached_ids) for layer in engine._kv.layers)


# (family, layer of the interrupt, n-th expert output): prefill (T tokens: every expert of the layer
# runs once per forward) or a decode step (K = 2 expert outputs per layer and step).
CASES = [("mixtral", 1, 3, "prefill"), ("mixtral", 2, 8 + 2 * 3, "decode"), ("gpt_oss", 1, 8 + 2 * 2, "decode"),
         ("deepseek_v3", 2, 2, "prefill")]


@pytest.mark.parametrize("family,layer,n,where", CASES)
def test_interrupt_leaves_a_consistent_runtime(tiny_models, adapter_models, family, layer, n, where):
    folder = {**tiny_models, **adapter_models}[family]
    session = _session(folder, link_gbps=0.001)  # ~6 ms per expert copy: copies are queued
    fresh = _session(folder)
    try:
        "".join(session.send("Hello there"))
        history = [dict(m) for m in session.history]
        with session.engine.om.observing(InterruptAt(layer, n)), pytest.raises(KeyboardInterrupt):
            "".join(session.send("And now?"))
        _assert_consistent(session)
        turn = session.last
        assert turn.interrupted
        if where == "prefill":
            assert turn.token_ids == [] and session.history == history  # question dropped with it
        else:
            assert len(turn.token_ids) >= 1
            kept = session.history[len(history):]
            assert [m["role"] for m in kept] == (["user", "assistant"] if turn.text else [])
            if turn.text:
                assert kept[1]["content"] == turn.text
        # The next turn equals a fresh session with the same history, and transformers.
        fresh.history = [dict(m) for m in session.history]
        ids = render(session.tokenizer, session.messages("Why?")).ids
        got = "".join(session.send("Why?"))
        assert got == "".join(fresh.send("Why?"))
        assert session.last.token_ids == fresh.last.token_ids
        with torch.no_grad():
            want = reference_model(folder).generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        want = want[0, len(ids):].tolist()
        stopped = want[-1] in session.stop_ids()
        assert session.last.token_ids == (want[:-1] if stopped else want)
        _assert_consistent(session)
    finally:
        session.engine.om.close()
        fresh.engine.om.close()


def test_interrupt_between_tokens_keeps_what_was_shown(tiny_models):
    """Ctrl-C while the caller prints (the generator is closed between tokens)."""
    session = _session(tiny_models["qwen3_moe"])
    try:
        pieces = session.send("Hello there")
        shown = next(pieces)  # the first piece; the answer has more tokens to come
        pieces.close()
        session.engine.abort()  # what the REPL does after Ctrl-C: harmless between forwards
        _assert_consistent(session)
        assert session.last.interrupted and session.last.text == shown
        assert session.history[-1] == {"role": "assistant", "content": shown}
    finally:
        session.engine.om.close()


def test_cancel_pending_drops_queued_copies_and_cuts_the_link_wait():
    engine = ThreadTransferEngine(link_gbps=1e-7)  # 100 bytes/s: one 10 kB copy "takes" 100 s
    try:
        src, dst = torch.ones(2500), torch.zeros(3, 2500)  # float32: 10 kB each
        tickets = [engine.submit(dst[i], src, slot=i) for i in range(3)]
        while not tickets[0].started:  # the worker picked the first copy (its bytes land at once)
            tickets[0].done.wait(0.01)
        dropped = engine.cancel_pending()
        assert dropped == tickets[1:] and all(t.cancelled for t in dropped)
        assert tickets[0].done.is_set() and torch.equal(dst[0], src)
        assert tickets[0].copy_s < 50  # the emulated 100 s were cut short
        assert engine.bytes_moved == 10_000 and not dst[1:].any()
    finally:
        engine.close()
