"""scripts/copy_share_grid.py: a cell's ratios, the flags of failed must-holds, the 80-column table."""

from __future__ import annotations


import pytest
from tiny import load_script

@pytest.fixture(scope="module")
def grid():
    return load_script("copy_share_grid")


def _report(share, slots, policy, tpot, mb):
    """A profile report's fields the grid reads: strategy -> TPOT ms, strategy -> MB/token."""
    return {"options": {"cache_experts": slots, "cache_policy": policy},
            "copy_share": {"asked": share, "reached": {"32": share - 0.01}},
            "results": [{"strategy": n, "tpot_ms": {"mean": tpot[n]}, "h2d_bytes_per_token": mb[n] * 1e6,
                         "hit_rate": 0.5} for n in tpot]}


def test_a_cell_that_holds(grid):
    cell = grid.summarise(_report(0.75, 120, "lfru", {"none": 400.0, "router": 340.0, "oracle": 300.0},
                                  {"none": 40.0, "router": 42.0, "oracle": 40.0}), "lfru")
    assert cell["ratio"] == {"router": 0.85, "oracle": 0.75}
    assert cell["fails"] == []
    assert grid.best_predictor(cell) == ("router", 0.85)  # the oracle is no predictor
    v = grid.verdict([cell])
    assert v["every_predictor_le_1"] and v["oracle_bytes_le_none"] and v["best_le_0.85"]


def test_flags_slower_predictor_more_oracle_bytes_and_a_fallen_back_policy(grid):
    cell = grid.summarise(_report(0.75, 120, "lru", {"none": 400.0, "router": 404.0, "oracle": 380.0},
                                  {"none": 40.0, "router": 42.0, "oracle": 40.5}), "lfru")
    assert cell["fails"] == ["T", "B", "P"]
    v = grid.verdict([cell])
    assert not v["every_predictor_le_1"] and not v["oracle_bytes_le_none"]
    assert v["best_le_0.85"] is False  # router 1.01x


def test_the_table_fits_80_columns(grid):
    cells = [grid.summarise(_report(s, n, p, {"none": 1973.2, "router": 1900.0, "quasi": 1950.0, "oracle": 1800.0},
                                    {"none": 65.53, "router": 69.17, "quasi": 69.28, "oracle": 66.36}), p)
             for s in (0.25, 0.9) for n in (8, 240) for p in ("lru", "lfru")]
    lines = grid.table(cells, ["quasi", "router", "oracle"])
    assert len(lines) == 9
    assert max(len(line) for line in lines) <= 80
    assert lines[1].split()[:5] == ["0.25", "(0.24)", "8", "lru", "1973.2"]
    assert lines[1].endswith(" 65.53  66.36 B")
