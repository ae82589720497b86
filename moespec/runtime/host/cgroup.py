"""The RAM this process's memory cgroup still allows (a container's or a `memcap.sh` limit).

Linux's MemAvailable is the host's: inside a container (Docker, Kubernetes, systemd slices) or under
scripts/memcap.sh the process may use far less, and a store sized from MemAvailable is killed by the
cgroup's OOM killer instead of going to the disk tier (issue 27). The limit counts the page cache, so
what is free is the limit less the usage plus the inactive file pages the kernel reclaims first (the
"working set" Docker and the kubelet report).

cgroup v2: ``/proc/self/cgroup`` has the line ``0::PATH``; ``<root>/PATH/memory.max`` ("max" when
unlimited), ``memory.current``, ``memory.stat`` (``inactive_file``). cgroup v1: the line naming the
``memory`` controller; ``<root>/memory/PATH/memory.limit_in_bytes`` (about 2**63 when unlimited),
``memory.usage_in_bytes``, ``memory.stat`` (``total_inactive_file``). Each limit up the tree counts:
the smallest free amount of the process's group and its parents is returned.
"""

from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 60  # a v1 limit at or above this is "no limit" (the kernel shows 2**63 rounded to pages)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    return None if text in ("", "max") or not text.isdigit() else int(text)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _free_in(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> tuple[int, int] | None:
    """(free bytes, limit) of ``group`` (None: no limit there or unreadable)."""
    limit = _read_int(group / limit_file)
    if limit is None or limit >= UNLIMITED:
        return None
    usage = _read_int(group / usage_file)
    if usage is None:
        return None
    return max(limit - usage + _stat(group / "memory.stat", inactive_key), 0), limit


def cgroup_free_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate under its memory cgroup's limits (module docstring), or None
    when no limit applies or it cannot be read (not Linux, no cgroup filesystem)."""
    got = cgroup_memory(proc_cgroup, root)
    return None if got is None else got[0]


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(free bytes, limit bytes) of the tightest memory limit over this process's cgroup and its parents
    (the one with the least free), or None when no limit applies or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    groups: list[tuple[Path, str, str, str]] = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if "memory" in controllers.split(","):  # v1
            groups.append((root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes",
                           "total_inactive_file"))
        elif hid == "0" and controllers == "":  # v2 (a hybrid host lists both; v1's memory line wins then)
            groups.append((root / rel, "memory.max", "memory.current", "inactive_file"))
    if any(g[1] == "memory.limit_in_bytes" for g in groups):
        groups = [g for g in groups if g[1] == "memory.limit_in_bytes"]
    free: tuple[int, int] | None = None
    for base, limit_file, usage_file, key in groups:
        top = root / "memory" if limit_file == "memory.limit_in_bytes" else root
        group = base
        while True:  # the group and each parent up to the hierarchy's root: every limit counts
            got = _free_in(group, limit_file, usage_file, key)
            if got is not None and (free is None or got[0] < free[0]):
                free = got
            if group == top or top not in group.parents:
                break
            group = group.parent
    return free
