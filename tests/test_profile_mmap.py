"""`moespec profile --strategies ...,mmap`: the disk tier beside its mmap baseline (issue 27).

The mmap arm runs on a second load of the model that reads the same store file through the page
cache (a read-only mapping, no O_DIRECT, no prediction), on the trace of the first load: the same
greedy tokens (top-1 agreement 1, KL 0, the same token digest), and the report says per strategy
how rows were read, disk bytes per token and disk GB/s. Without a disk tier it is one typed error.
"""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from tiny import profile_on_disk

from moespec.cli.app import app
from moespec.config import Predictor
from moespec.errors import OptionError
from moespec.profile.schema import validate
from moespec.profile.strategy import MMAP, guard_arms, parse_strategies


@pytest.fixture(scope="module")
def folder(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "m"
    shutil.copytree(tiny_models["qwen3_moe"], out)  # 3 MoE layers x 8 float32 experts of 6 KiB, top-2
    return out


@pytest.fixture(scope="module")
def profiled(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    # module-scoped, so conftest's per-test home does not apply yet: the store file goes to a temp home
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESPEC_HOME", str(tmp_path_factory.mktemp("home")))
        return profile_on_disk(folder, out, "none,router,mmap", repeats=2)


def test_mmap_gives_the_same_greedy_tokens_as_the_other_strategies(profiled):
    rep, _, _ = profiled
    assert validate(rep) == []
    assert [r["strategy"] for r in rep["results"]] == ["none", "router", "mmap"]
    assert len({r["token_sha256"] for r in rep["results"]}) == 1
    for r in rep["results"]:
        assert r["quality"]["top1_agreement"] == 1.0 and r["quality"]["kl_mean"] < 1e-6, r["strategy"]
        assert r["totals"]["repeats"] == 2 and r["totals"]["decode_tokens"] == 8


def test_the_report_says_how_each_arm_read_the_disk(profiled):
    rep, _, output = profiled
    by = {r["strategy"]: r for r in rep["results"]}
    assert by["none"]["disk"]["reads"] == by["router"]["disk"]["reads"] == "O_DIRECT"
    assert by["mmap"]["disk"]["reads"] == "page cache"
    assert by["mmap"]["recall"] is None and by["mmap"]["prefetched_per_token"] == 0  # no prediction
    eb = rep["model"]["expert_bytes"]
    for r in rep["results"]:
        d = r["disk"]
        assert d["bytes_per_token"] >= 0 and set(d) == {"reads", "counted", "bytes_per_token", "gbps"}
        assert r["totals"]["copy_bytes"] == (r["totals"]["misses"] + r["totals"]["prefetched"]) * eb > 0
        assert r["tpot_ms"]["mean"] > 0 and r["link_gbps_achieved"] > 0
    # the O_DIRECT arms read whole rows from the disk: counted by the kernel, at least the rows copied
    for name in ("none", "router"):
        d = by[name]["disk"]
        if d["counted"] == "/proc/self/io":
            assert d["bytes_per_token"] * 8 >= by[name]["totals"]["copy_bytes"]
    assert rep["page_cache"] == ("dropped" if os.geteuid() == 0 else "store file")
    assert "mmap" in output and "disk" in output and "page cache" in output
    assert max(len(line) for line in output.splitlines()) <= 80


def test_the_trace_names_the_mmap_arms_lane(profiled):
    _, trace, _ = profiled
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"compute", "disk read (O_DIRECT)", "disk read (page cache)"}


def test_mmap_without_a_disk_tier_is_one_typed_error_naming_the_flag(folder):
    res = CliRunner().invoke(app, ["profile", str(folder), "--device", "cpu", "--strategies", "none,mmap",
                                   "--prompt-len", "8", "--gen", "2", "--repeats", "1"], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("error:") and "--strategies mmap" in lines[0] and "disk" in lines[0]
    assert "--host-memory" in res.output and "Traceback" not in res.output


def test_mmap_parses_as_the_baseline_and_refuses_another_on_miss():
    (s,) = parse_strategies("mmap")
    assert s.name == MMAP and s.reads == MMAP and s.predictor == Predictor.NONE
    assert [a.name for a in guard_arms((s,), (0.1,))] == ["mmap", "mmap@0.1"]
    assert [a.name for a in parse_strategies("none,mmap,mmap+fetch")] == ["none", "mmap"]
    with pytest.raises(OptionError, match="--strategies 'mmap\\+host'"):
        parse_strategies("mmap+host")


def test_an_unknown_strategy_lists_mmap_among_the_choices():
    with pytest.raises(OptionError) as err:
        parse_strategies("psychic")
    assert "mmap" in err.value.hint and "router" in err.value.hint


def test_not_root_only_the_store_files_pages_are_dropped(tmp_path, monkeypatch):
    from moespec.runtime.host import page_cache

    path = tmp_path / "rows.bin"
    path.write_bytes(b"x" * 8192)
    wrote = []
    monkeypatch.setattr(page_cache.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(page_cache, "DROP_CACHES", type("P", (), {"write_text": lambda self, t: wrote.append(t)})())
    assert page_cache.drop(path) is False and wrote == []  # drop_caches never touched without root
    monkeypatch.setattr(page_cache.os, "geteuid", lambda: 0)
    assert page_cache.drop(path) is True and wrote == ["1"]



def test_read_bytes_comes_from_proc_self_io_else_none(tmp_path, monkeypatch):
    from moespec.runtime.host import page_cache

    io = tmp_path / "io"
    io.write_text("rchar: 10\nread_bytes: 12288\nwrite_bytes: 0\n")
    monkeypatch.setattr(page_cache, "PROC_IO", io)
    assert page_cache.read_bytes() == 12288
    monkeypatch.setattr(page_cache, "PROC_IO", tmp_path / "missing")
    assert page_cache.read_bytes() is None


def test_the_table_notes_when_only_the_store_file_was_dropped(profiled):
    from rich.console import Console

    from moespec.profile.render import render_report

    rep = dict(profiled[0], page_cache="store file")
    console = Console(width=80, record=True)
    render_report(rep, console)
    text = console.export_text()
    assert "not root: only the store file's pages dropped before each run" in text
    assert "disk" in text and "MB/tok" in text
