"""GGUF rows on a real GPU (skipped without one): exact, and dequantised after the copy without a sync.

The dequantisers build no constant on the device (every shift is a Python int), so computing an
expert from a GGUF row issues no synchronizing operation; transformers' own dequantisers would
(one pageable host-to-device copy per call, test_gguf_dequant.py compares their values).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import GREEDY_PROMPT
from tiny_gguf import write_gguf

from moespec.config import Predictor, RuntimeConfig
from moespec.gguf.export import ExportTypes
from moespec.runtime.load import load_offloaded

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family,types", [("qwen3_moe", ExportTypes("Q4_K", per_layer={(1, "down"): "Q6_K"})),
                                          ("gpt_oss", ExportTypes("MXFP4")), ("mixtral", ExportTypes("Q8_0"))])
def test_gguf_rows_on_cuda_exact_and_sync_free(tmp_path, family, types):
    from moespec.hub.resolve import resolve_model

    cfg = dict(hidden=256, inter=256, layers=2, experts=4) if types.experts == "Q4_K" else dict(hidden=64, inter=64)
    path, ref = write_gguf(tmp_path, family, types, **cfg)
    ids = torch.tensor([GREEDY_PROMPT])
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(resolve_model(str(path)), RuntimeConfig(device="cuda", dtype="float32", cache_experts=4,
                                                                predictor=Predictor.NONE))
    try:
        with torch.inference_mode():
            got = om.model(ids.cuda()).logits.cpu()
            layer = om.store.moe_layers[0]
            layout = om.store.layout.for_layer(layer)
            row = om.store.expert(layer, 0).cuda()
            x = torch.randn(1, layout.hidden, device="cuda")
            layout.forward(x, row, torch.nn.functional.silu)  # warm-up: tables are built once per device
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layout.forward(x, row, torch.nn.functional.silu)
            torch.cuda.set_sync_debug_mode(0)
    finally:
        om.close()
    assert (got - want).abs().max() < 1e-4
    assert not [w for w in caught if "synchroniz" in str(w.message)]
