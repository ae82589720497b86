"""Where a miss comes from and runs, with three places its row can be: device cache, RAM tier, disk.

Shapes: t tokens routed to one expert.

planner.py decides device vs host for rows that are all in host RAM. With the disk tier a row may
also be only on disk, and host compute of a miss needs its row in RAM (issue 27), so a disk row is
read first and only then computed, on the host from the RAM slot it landed in, or on the device
after one more copy. :func:`plan_tiers` is that choice for one layer, a greedy list schedule as
planner.py's, nearest place first (device rows, then RAM rows, whose copies need not wait for a disk
read, then disk rows; the given order within each): each miss takes the route that finishes first
and that route's resources (the disk, the link, the device, a host worker) advance.

  place   route        finishes at (ms from now)
  device  DEVICE       device free + device_ms(t)
  ram     FETCH        max(link free + copy_ms, device free) + device_ms(t)
          HOST         host worker free + host_ms(t)
  disk    DISK_FETCH   max(disk free + disk_ms, link free) + copy_ms, then as FETCH from there
          DISK_HOST    max(disk free + disk_ms, host worker free) + host_ms(t)

On CPU the RAM tier is the device cache (``ram_is_device``): a RAM row is resident (DEVICE or HOST:
the same memory, no copy) and a disk row lands where both read it (DISK_DEVICE or DISK_HOST). The
costs are measured ones (:meth:`TierCosts.measured`: the disk reader's and the link's GB/s over a
row's bytes; planner.Costs' compute lines). Not wired into the runtime yet: the disk tier runs on the
CPU only, where ``--on-miss fetch`` is required (disk_tier.py); this is the rule it will use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Place(enum.Enum):
    """Where a miss's row is now."""

    DEVICE = "device"
    RAM = "ram"
    DISK = "disk"


class Route(enum.Enum):
    """How a miss is served (module docstring's table)."""

    DEVICE = "device"
    FETCH = "fetch"
    HOST = "host"
    DISK_FETCH = "disk+fetch"
    DISK_DEVICE = "disk+device"
    DISK_HOST = "disk+host"


@dataclass(frozen=True)
class TierCosts:
    """Measured ms of one expert row: read from disk, copied RAM -> device, computed for 1 and 16 tokens.

    Attributes:
        disk_ms: one row disk -> RAM (row bytes / the reader's GB/s).
        copy_ms: one row RAM -> device (0 where the RAM tier is the device cache).
        host_ms_1, host_ms_16, device_ms_1, device_ms_16: compute of one expert (planner.Costs' lines).
        ram_is_device: CPU: the RAM tier is the device cache (module docstring).
    """

    disk_ms: float
    copy_ms: float
    host_ms_1: float
    host_ms_16: float
    device_ms_1: float
    device_ms_16: float
    ram_is_device: bool = False

    @classmethod
    def measured(cls, row_bytes: int, disk_gbps: float, link_gbps: float | None, host_ms: tuple[float, float],
                 device_ms: tuple[float, float]) -> TierCosts:
        """From measured rates: ``link_gbps`` None on CPU (RAM is the device cache, no copy)."""
        disk_ms = row_bytes / disk_gbps / 1e6
        copy_ms = 0.0 if link_gbps is None else row_bytes / link_gbps / 1e6
        return cls(disk_ms, copy_ms, *host_ms, *device_ms, ram_is_device=link_gbps is None)

    @staticmethod
    def _line(ms_1: float, ms_16: float, t: int) -> float:
        b = (ms_16 - ms_1) / 15
        return max(ms_1 - b, 0.0) + b * t

    def host_ms(self, t: int) -> float:
        return self._line(self.host_ms_1, self.host_ms_16, t)

    def device_ms(self, t: int) -> float:
        return self._line(self.device_ms_1, self.device_ms_16, t)


@dataclass(frozen=True)
class TierPlan:
    """Each miss's route and finish (ms from now), and when the layer's last expert is done."""

    routes: dict[int, Route]
    done_ms: dict[int, float]

    @property
    def layer_ms(self) -> float:
        return max(self.done_ms.values(), default=0.0)


def plan_tiers(costs: TierCosts, misses: list[tuple[int, int, Place]], host_workers: int = 1,
               device_free_ms: float = 0.0, link_free_ms: float = 0.0, disk_free_ms: float = 0.0) -> TierPlan:
    """Route each (expert, t, place) of one layer, nearest place first (module docstring's rule).

    Args:
        host_workers: the host pool's threads (0: no host compute).
        device_free_ms, link_free_ms, disk_free_ms: when each is free of work already queued.
    """
    c = costs
    dev, link, disk = device_free_ms, link_free_ms, disk_free_ms
    workers = [0.0] * host_workers
    routes, done = {}, {}
    nearest = {Place.DEVICE: 0, Place.RAM: 1, Place.DISK: 2}
    for e, t, place in sorted(misses, key=lambda m: nearest[m[2]]):  # stable: the given order within a place
        w = min(range(len(workers)), key=workers.__getitem__) if workers else None
        host_at = workers[w] if workers else float("inf")
        read = disk + c.disk_ms if place is Place.DISK else 0.0  # the row lands in RAM here
        options = []  # (finish, route, new clocks (dev, link, disk), host worker's new clock or None)
        if place is Place.DEVICE or (place is Place.RAM and c.ram_is_device):
            options.append((dev + c.device_ms(t), Route.DEVICE, (dev + c.device_ms(t), link, disk), None))
        elif place is Place.RAM:
            fin = max(link + c.copy_ms, dev) + c.device_ms(t)
            options.append((fin, Route.FETCH, (fin, link + c.copy_ms, disk), None))
        elif c.ram_is_device:
            fin = max(read, dev) + c.device_ms(t)
            options.append((fin, Route.DISK_DEVICE, (fin, link, read), None))
        else:
            landed = max(read, link) + c.copy_ms
            fin = max(landed, dev) + c.device_ms(t)
            options.append((fin, Route.DISK_FETCH, (fin, landed, read), None))
        if workers and place is not Place.DEVICE:
            fin = max(read, host_at) + c.host_ms(t)  # host compute needs the row in RAM first
            route = Route.DISK_HOST if place is Place.DISK else Route.HOST
            options.append((fin, route, (dev, link, read if place is Place.DISK else disk), fin))
        fin, route, (dev, link, disk), host = min(options, key=lambda o: o[0])
        if host is not None:
            workers[w] = host
        routes[e], done[e] = route, fin
    return TierPlan(routes, done)
