"""scripts/disk_hold_table.py: an arm's floor from the reader of its own process, else the hold's."""

from __future__ import annotations

import json

import pytest
from tiny import load_script

@pytest.fixture(scope="module")
def table():
    return load_script("disk_hold_table")


def _row(arm, **kw):
    return {"arm": arm, "round": 1, "hold": "h", "rc": 0, "peak_mib": 2048, "cap_mib": 2048, **kw}


def test_an_arm_with_its_own_reader_takes_its_floor_from_it(table, tmp_path):
    rows = [_row("reader", gbps=1.0),
            _row("router", tpot_ms=300.0, decode_disk_mb_per_token=600.0, decode_disk_gbps=2.4,
                 reader_gbps_before=2.6, reader_gbps_after=2.4),
            _row("none", tpot_ms=400.0, decode_disk_mb_per_token=600.0, decode_disk_gbps=2.0)]
    path = tmp_path / "hold.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    got = table.numbers(table.rows_by_hold(path)["h"])
    # router: its own reader, (2.6 + 2.4) / 2 = 2.5 GB/s -> floor 600 MB / 2.5 = 240 ms
    assert got["router"]["own_reader"] == 2.5
    assert got["router"]["floor_ms"] == 240.0 and got["router"]["x_floor"] == 1.25
    assert got["router"]["reader_share"] == 0.96 and got["router"]["x_none"] == 0.75
    # none ran no reader of its own: the hold's reader arm, 1.0 GB/s -> 600 ms
    assert got["none"]["own_reader"] is None and got["none"]["floor_ms"] == 600.0
    text = table.render(table.rows_by_hold(path))
    assert "own reader GB/s (before/after): router 2.6/2.4" in text
    assert max(len(line) for line in text.splitlines()) <= 80
