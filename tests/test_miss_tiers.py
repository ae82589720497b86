"""The three-place miss planner (runtime/misses/tiers.py) with emulated costs: each route is chosen
where it finishes first, a disk row is read before any compute, and the disk is one queue."""

from __future__ import annotations

import pytest

from moespec.runtime.misses.tiers import Place, Route, TierCosts, plan_tiers

D, R, K = Place.DEVICE, Place.RAM, Place.DISK


def _gpu(disk_ms=5.0, copy_ms=1.0, host_ms=2.0, device_ms=0.1) -> TierCosts:
    return TierCosts(disk_ms, copy_ms, host_ms, host_ms * 4, device_ms, device_ms * 2)


def test_a_device_row_runs_on_the_device():
    plan = plan_tiers(_gpu(), [(0, 1, D)])
    assert plan.routes == {0: Route.DEVICE} and plan.done_ms[0] == pytest.approx(0.1)


@pytest.mark.parametrize("copy_ms, host_ms, route", [(1.0, 2.0, Route.FETCH), (4.0, 2.0, Route.HOST)])
def test_a_ram_row_is_fetched_or_computed_on_the_host_whichever_ends_first(copy_ms, host_ms, route):
    plan = plan_tiers(_gpu(copy_ms=copy_ms, host_ms=host_ms), [(0, 1, R)])
    assert plan.routes == {0: route}
    assert plan.done_ms[0] == pytest.approx(min(copy_ms + 0.1, host_ms))


@pytest.mark.parametrize("copy_ms, host_ms, route", [(1.0, 2.0, Route.DISK_FETCH), (4.0, 2.0, Route.DISK_HOST)])
def test_a_disk_row_is_read_first_then_fetched_or_computed_on_the_host(copy_ms, host_ms, route):
    plan = plan_tiers(_gpu(disk_ms=5.0, copy_ms=copy_ms, host_ms=host_ms), [(0, 1, K)])
    assert plan.routes == {0: route}
    # host compute needs the row in RAM: nothing finishes before the read (5 ms) plus its compute
    assert plan.done_ms[0] == pytest.approx(5.0 + min(copy_ms + 0.1, host_ms))


def test_the_disk_is_one_queue_and_ram_rows_go_beside_it():
    c = _gpu(disk_ms=5.0, copy_ms=1.0, host_ms=3.0)
    plan = plan_tiers(c, [(0, 1, K), (1, 1, K), (2, 1, R)], host_workers=1)
    assert plan.routes[2] == Route.FETCH and plan.done_ms[2] == pytest.approx(1.1)  # not behind the disk
    assert plan.done_ms[0] == pytest.approx(6.1)  # read 5, copy 1, compute 0.1
    assert plan.done_ms[1] == pytest.approx(11.1)  # read after the first (10), copy, compute
    assert plan.layer_ms == pytest.approx(11.1)


def test_a_busy_link_sends_a_ram_row_to_the_host():
    plan = plan_tiers(_gpu(copy_ms=1.0, host_ms=2.0), [(0, 1, R)], link_free_ms=3.0)
    assert plan.routes == {0: Route.HOST}


def test_without_host_workers_every_row_goes_through_the_device():
    plan = plan_tiers(_gpu(copy_ms=4.0, host_ms=0.5), [(0, 1, R), (1, 1, K)], host_workers=0)
    assert plan.routes == {0: Route.FETCH, 1: Route.DISK_FETCH}


def test_on_cpu_a_ram_row_is_resident_and_a_disk_row_lands_where_both_read_it():
    c = TierCosts.measured(4 << 20, disk_gbps=1.5, link_gbps=None, host_ms=(0.4, 1.6), device_ms=(0.3, 1.2))
    assert c.ram_is_device and c.copy_ms == 0.0 and c.disk_ms == pytest.approx(2.796, abs=1e-3)
    plan = plan_tiers(c, [(0, 1, R), (1, 1, K)], host_workers=1)
    assert plan.routes == {0: Route.DEVICE, 1: Route.DISK_DEVICE}  # no copy; the device is 0.1 ms faster
    assert plan.done_ms[1] == pytest.approx(c.disk_ms + 0.3)
    busy = plan_tiers(c, [(1, 1, K)], host_workers=1, device_free_ms=3.0)  # the device still busy at landing
    assert busy.routes == {1: Route.DISK_HOST} and busy.done_ms[1] == pytest.approx(c.disk_ms + 0.4)


def test_measured_costs_divide_row_bytes_by_the_rates():
    c = TierCosts.measured(8_000_000, disk_gbps=2.0, link_gbps=20.0, host_ms=(1.0, 4.0), device_ms=(0.1, 0.2))
    assert (c.disk_ms, c.copy_ms, c.ram_is_device) == (pytest.approx(4.0), pytest.approx(0.4), False)
    assert c.host_ms(16) == pytest.approx(4.0) and c.host_ms(1) == pytest.approx(1.0)
