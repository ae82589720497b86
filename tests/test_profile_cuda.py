"""`moespec profile` on a CUDA device (skipped without one): the same accounting, real streams."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moespec.cli.app import app

pytestmark = pytest.mark.cuda


def test_profile_on_cuda_adds_up(tiny_models, tmp_path):
    res = CliRunner().invoke(app, [
        "profile", str(tiny_models["qwen3_moe"]), "--device", "cuda", "--cache-experts", "4",
        "--strategies", "none,router,oracle", "--prompt-len", "8", "--gen", "4", "--repeats", "2", "--warmup", "1",
        "--out", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["link"]["pinned"] and rep["hardware"]["device"].startswith("cuda")
    assert 0 < rep["link"]["measured_gbps"] < 1e4  # timed copies (a 0-second busy time gave inf)
    eb = rep["model"]["expert_bytes"]
    for r in rep["results"]:
        t = r["totals"]
        assert t["hits"] + t["misses"] == 2 * 3 * t["decode_tokens"]
        assert t["h2d_bytes"] == (t["misses"] + t["prefetched"]) * eb == t["copy_bytes"]
        assert r["quality"]["top1_agreement"] == 1.0
    oracle = next(r for r in rep["results"] if r["strategy"] == "oracle")
    assert oracle["recall"] == 1.0
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    copies = [e for e in spans if e["tid"] == 2]
    assert copies and all(e["dur"] >= 0 for e in copies)


def test_ticket_timestamps_on_cuda():
    from moespec.runtime.transfer import Span
    from moespec.runtime.transfer.cuda import CudaTransferEngine

    dev = torch.device("cuda", torch.cuda.current_device())
    eng = CudaTransferEngine(dev, num_slots=1)
    eng.set_timing(True)  # copies carry timing events only while something records
    src = torch.randn(1 << 20).pin_memory()
    dst = torch.empty(1 << 20, device=dev)
    ref = eng.mark()
    ticket = eng.submit(dst, src, 0)
    eng.synchronize()
    assert Span(ref, ticket.start).ms() >= 0 and Span(ticket.start, ticket.end).ms() > 0
    assert torch.equal(dst.cpu(), src)
    eng.set_timing(False)
    untimed = eng.submit(dst, src, 0)
    eng.synchronize()
    assert untimed.start is None and untimed.done is not None
    eng.close()
