"""host/cgroup.py: the RAM a memory cgroup still allows, on fake v1 and v2 trees (and the real one)."""

from __future__ import annotations

import pytest

from moespec.runtime.host import memory
from moespec.runtime.host.cgroup import cgroup_free_bytes, cgroup_memory

MiB = 2**20


def _v1(tmp_path, limit, usage, inactive=0, parent_limit=9223372036854771712):
    group = tmp_path / "memory" / "outer" / "job"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (group / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (group / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive}\ntotal_rss 7\n")
    (group.parent / "memory.limit_in_bytes").write_text(f"{parent_limit}\n")
    (group.parent / "memory.usage_in_bytes").write_text(f"{usage}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/\n4:memory:/outer/job\n0::/\n")
    return proc


def test_v1_free_is_limit_less_usage_plus_inactive_file(tmp_path):
    proc = _v1(tmp_path, limit=1400 * MiB, usage=600 * MiB, inactive=100 * MiB)
    assert cgroup_free_bytes(proc, tmp_path) == 900 * MiB


def test_v1_a_parents_smaller_limit_counts(tmp_path):
    proc = _v1(tmp_path, limit=1400 * MiB, usage=600 * MiB, parent_limit=1000 * MiB)
    assert cgroup_free_bytes(proc, tmp_path) == 400 * MiB
    assert cgroup_memory(proc, tmp_path) == (400 * MiB, 1000 * MiB)  # the tightest group's limit


def test_v1_unlimited_is_none(tmp_path):
    proc = _v1(tmp_path, limit=9223372036854771712, usage=600 * MiB)
    assert cgroup_free_bytes(proc, tmp_path) is None


def test_v2_max_current_and_inactive_file(tmp_path):
    group = tmp_path / "user.slice" / "job"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("2147483648\n")
    (group / "memory.current").write_text(f"{512 * MiB}\n")
    (group / "memory.stat").write_text(f"anon 1\ninactive_file {64 * MiB}\n")
    (group.parent / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    assert cgroup_free_bytes(proc, tmp_path) == 2048 * MiB - 512 * MiB + 64 * MiB
    (group / "memory.max").write_text("max\n")
    assert cgroup_free_bytes(proc, tmp_path) is None


def test_no_cgroup_file_is_none(tmp_path):
    assert cgroup_free_bytes(tmp_path / "absent", tmp_path) is None


def test_available_bytes_is_at_most_the_cgroups_free_ram(monkeypatch):
    monkeypatch.delenv("MOESPEC_HOST_RAM_BYTES", raising=False)
    monkeypatch.setattr("moespec.runtime.host.cgroup.cgroup_free_bytes", lambda: 300 * MiB)
    assert memory.available_bytes() == 300 * MiB
    monkeypatch.setattr("moespec.runtime.host.cgroup.cgroup_free_bytes", lambda: None)
    assert memory.available_bytes() > 300 * MiB  # MemAvailable (this machine has GiBs)
    monkeypatch.setenv("MOESPEC_HOST_RAM_BYTES", str(7 * MiB))
    assert memory.available_bytes() == 7 * MiB  # the override wins


def test_the_headroom_is_a_tenth_of_a_cgroup_limit_at_most_512_mib(monkeypatch):
    monkeypatch.delenv("MOESPEC_HOST_RAM_BYTES", raising=False)
    monkeypatch.setattr("moespec.runtime.host.cgroup.cgroup_memory", lambda: (900 * MiB, 1400 * MiB))
    assert memory.headroom_bytes() == 140 * MiB
    monkeypatch.setattr("moespec.runtime.host.cgroup.cgroup_memory", lambda: (9 * 2**30, 16 * 2**30))
    assert memory.headroom_bytes() == 512 * MiB == memory.HEADROOM_BYTES
    monkeypatch.setattr("moespec.runtime.host.cgroup.cgroup_memory", lambda: None)
    assert memory.headroom_bytes() == 512 * MiB


def test_the_real_cgroup_reads_without_error():
    got = cgroup_free_bytes()
    assert got is None or got >= 0
    if got is not None:
        pytest.skip(f"this process runs under a memory limit: {got / MiB:.0f} MiB free")
