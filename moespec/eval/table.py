"""The quality table for people: one row per task and arm, fitted to the terminal (tables.fit_tables)."""

from __future__ import annotations

from moespec.eval.arms import Arm
from moespec.eval.data import TaskData
from moespec.eval.report import METRICS, Cell
from moespec.tables import Column, fit_tables

FOOTNOTE = ("score: acc (multiple choice), exact match of the last number (generation); 2nd: acc_norm (per "
            "character), exact match after \"the answer is\"; 95% CI: bootstrap over items; Δ: arm − exact on "
            "the same items; p: exact McNemar test; +/−: items only the arm / only exact got right; same: items "
            "answered as exact (the same choice, the same generated text)")


def _num(x: float, digits: int = 3, signed: bool = False) -> str:
    text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return text.replace("-", "−")


def _p(p: float) -> str:
    return "<0.01" if p < 0.01 else f"{p:.2f}"


def quality_tables(title: str, tasks: list[TaskData], arms: list[Arm], cells: dict, width: int | None) -> list:
    """Rich tables: per task a title row (name, items), then per arm: score, 95% CI, Δ vs exact, p, +/−,
    the share answered as exact, the second metric."""
    key = [Column("arm", justify="left")]
    cols = [Column("score"), Column("95% CI"), Column("Δ"), Column("p"), Column("+/−"), Column("same"),
            Column("2nd")]
    for task in tasks:
        first, second = (cells[task.name][m] for m in METRICS[task.kind])
        key[0].cells.append(f"[bold]{task.name}[/] n={first[arms[0].name].n}")
        for col in cols:
            col.cells.append("")
        for arm in arms:
            c: Cell = first[arm.name]
            d = c.vs_exact
            key[0].cells.append(f"  {arm.label}")
            row = [_num(c.score.value), f"{_num(c.score.low, 2)}–{_num(c.score.high, 2)}",
                   "—" if d is None else _num(d.delta.value, signed=True),
                   "" if d is None else _p(d.p_value), "" if d is None else f"+{d.gained}/−{d.lost}",
                   "" if d is None else f"{c.agree:.0%}", _num(second[arm.name].score.value)]
            for col, text in zip(cols, row):
                col.cells.append(text)
    return fit_tables(title, key, cols, width)


def _min_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def time_line(arms: list[Arm], results: dict, wall_s: float | None = None, workers: int = 1) -> str:
    """One line: this run's scoring wall time (the progress bars' elapsed time; model load excluded) and
    each arm's share of the scoring time over every run of its file (its items' seconds summed; with
    --workers they ran side by side, so the shares add up to more than the wall time)."""
    parts = [f"{a.label} {_min_s(sum(t.get('seconds', 0.0) for t in results[a.name].tasks.values()))}" for a in arms]
    head = "" if wall_s is None else f"wall time {_min_s(wall_s)}" + (f" ({workers} workers)" if workers > 1 else "") + "; "
    return head + "scoring time per arm (items summed): " + ", ".join(parts)
