"""`moespec profile --host-memory`: the strategies run on the disk tier, and the report and trace say so.

The link is the store file's reader (disk GB/s measured with reads in flight into aligned rows), the
trace's copy lane is the disk lane (one span per row read into the RAM tier), every byte the steps
count was read from disk, and the answers stay exact (top-1 agreement 1, KL 0).
"""

from __future__ import annotations

import shutil

import pytest

from tiny import profile_on_disk

from moespec.profile.schema import validate


@pytest.fixture(scope="module")
def profiled(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("m") / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)  # 3 MoE layers x 8 float32 experts of 6 KiB, top-2
    return profile_on_disk(folder, tmp_path_factory.mktemp("out"), "none,router", repeats=1, columns=200)


def test_the_report_names_the_disk_as_the_link_and_the_ram_tier_as_the_cache(profiled):
    rep, _, output = profiled
    assert validate(rep) == []
    assert rep["cache"]["experts_on"] == "disk" and rep["cache"]["slots"] == 5  # 40 KiB // 8 KiB rows
    assert rep["link"]["over"] == "disk" and rep["link"]["measured_gbps"] > 0
    assert "O_DIRECT" in rep["link"]["method"] and "8 in flight" in rep["link"]["method"]
    assert rep["options"]["host_memory"] == "40KiB"
    assert "disk " in output and " GB/s" in output
    eb = rep["model"]["expert_bytes"]
    for r in rep["results"]:
        t = r["totals"]
        assert t["copy_bytes"] == t["h2d_bytes"] == (t["misses"] + t["prefetched"]) * eb > 0
        assert r["quality"]["top1_agreement"] == 1.0 and r["quality"]["kl_mean"] < 1e-6


def test_the_trace_has_a_disk_lane_with_one_span_per_row_read(profiled):
    rep, trace, _ = profiled
    events = trace["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"compute", "disk read (O_DIRECT)"}
    reads = [e for e in events if e["ph"] == "X" and e["tid"] == 2]
    assert reads and all(e["args"]["bytes"] == rep["model"]["expert_bytes"] for e in reads)
    assert {e["args"]["kind"] for e in reads} <= {"demand", "prefetch"}
