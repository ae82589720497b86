"""The compiled dense path (runtime/compile.py) equals eager: logits within 1e-5 (float32) and the same
greedy tokens over a five-turn conversation (KV reuse, a crop, a re-prefill, a Ctrl-C in the middle
of a compiled decode); a compiler failure leaves one note and eager, never an exception.

One tiny model is compiled in the default run (inductor on CPU, ~20 s on 2 busy cores); every other
architecture is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from tiny import make_checkpoint

import moespec.runtime.compile as compile_mod
from moespec.config import Predictor, RuntimeConfig
from moespec.errors import OptionError
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(folder, compile_mode: str):
    return load_offloaded(folder, RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6, compile=compile_mode))


class _Interrupt:
    """Raises KeyboardInterrupt at the ``at``-th MoE layer call of the runner it wraps (a Ctrl-C
    between the compiled segment of a layer and its MoE dispatch)."""

    def __init__(self, runner, at: int) -> None:
        self.runner, self.at, self.n, self.run = runner, at, 0, runner.run

    def __call__(self, block, x):
        self.n += 1
        if self.n == self.at:
            raise KeyboardInterrupt
        return self.run(block, x)


def _conversation(folder, decode: int = 3) -> int:
    """Five turns on an eager and a compiled model; asserts logits and greedy tokens equal at every
    step. Returns the compiled segment calls (the compiled path must have run)."""
    eager, comp = _load(folder, "off"), _load(folder, "on")
    assert eager.compiled is None and comp.compiled is not None
    e, c = Engine(eager), Engine(comp)
    history: list[int] = _ids(10, 1)
    try:
        for turn in range(5):
            if turn == 2:  # the user edits the conversation: the cache is cut back and re-prefilled
                history = history[:7] + _ids(4, 50)
            prompt = history + _ids(3, 10 + turn)
            le, lc = e.prefill(prompt), c.prefill(prompt)
            assert c.reused_tokens == e.reused_tokens
            torch.testing.assert_close(lc, le, rtol=0, atol=1e-5)
            out = []
            for step in range(decode):
                tok = int(torch.argmax(le))
                assert int(torch.argmax(lc)) == tok, f"turn {turn} step {step}: greedy tokens differ"
                out.append(tok)
                if turn == 3 and step == 1:  # Ctrl-C inside a compiled decode step
                    runner = comp.runner
                    runner.run = _Interrupt(runner, 2)
                    with pytest.raises(KeyboardInterrupt):
                        c.forward([tok], "decode")
                    del runner.run
                le, lc = e.forward([tok], "decode"), c.forward([tok], "decode")
                torch.testing.assert_close(lc, le, rtol=0, atol=1e-5)
            history = prompt + out
        assert comp.notes == eager.notes  # no compile failure note
        return comp.compiled.calls
    finally:
        eager.close()
        comp.close()


def test_compiled_equals_eager_conversation(tiny_models):
    assert _conversation(tiny_models["qwen2_moe"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES[1:])
def test_compiled_equals_eager_every_family(tmp_path, family):
    assert _conversation(make_checkpoint(tmp_path / family, family, seed=5)) > 0


def test_every_layer_shares_one_graph(tmp_path):
    """Six lean decoder layers, KV lengths that grow, a crop and a re-prefill: three graphs in all
    (every layer's attention, the final norm, lm_head), so a start traces three, not two per layer."""
    from torch._dynamo.utils import counters

    folder = make_checkpoint(tmp_path / "six", "qwen2_moe", seed=2, layers=6)
    torch._dynamo.reset()
    counters.clear()
    om = _load(folder, "on")
    try:
        e = Engine(om)
        for turn, prompt in enumerate((_ids(9, 4), _ids(9, 4)[:5] + _ids(6, 7))):
            logits = e.prefill(prompt)
            for _ in range(3 + turn):
                logits = e.forward([int(torch.argmax(logits))], "decode")
        assert len(om.decode.steps) == 6
        assert counters["stats"]["unique_graphs"] == 3
        assert om.compiled.calls == 7 * 8 + 2  # 6 layers, norm, lm_head a step; a prefill's lm_head row
    finally:
        om.close()


def test_compile_failure_leaves_a_note_and_eager(tiny_models, monkeypatch):
    def broken(fn, **_):
        def run(*args, **kwargs):
            raise RuntimeError("inductor refused an op\nsecond line")
        return run

    monkeypatch.setattr(compile_mod.torch, "compile", broken)
    folder = tiny_models["qwen2_moe"]
    eager, comp = _load(folder, "off"), _load(folder, "on")
    try:
        e, c = Engine(eager), Engine(comp)
        prompt = _ids(9, 3)
        torch.testing.assert_close(c.prefill(prompt), e.prefill(prompt), rtol=0, atol=0)
        torch.testing.assert_close(c.forward([5], "decode"), e.forward([5], "decode"), rtol=0, atol=0)
        notes = [n for n in comp.notes if "compile failed" in n]
        assert notes == ["compile failed (RuntimeError: inductor refused an op): decoding eager"]
        assert comp.compiled.calls == 0
    finally:
        eager.close()
        comp.close()


def test_no_compiler_is_a_note(tiny_models, monkeypatch):
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    om = _load(tiny_models["qwen2_moe"], "on")
    try:
        assert om.compiled is None
        assert any(n.startswith("no C++ compiler") for n in om.notes)
        assert all(len(n) <= 100 for n in om.notes)
    finally:
        om.close()


def test_compile_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compile_mod.resolve_compile(m, cpu) for m in ("auto", "on", "off")] == [False, True, False]
    assert [compile_mod.resolve_compile(m, cuda) for m in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(OptionError, match="--compile 'fast'"):
        RuntimeConfig(compile="fast")
