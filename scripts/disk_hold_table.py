"""The table of a disk tier hold (scripts/disk_hold.sh): one block per hold, ratios within it.

    python scripts/disk_hold_table.py hold.jsonl [--json]

Per arm: TPOT ms, disk MB per decode token, decode read GB/s and its share of the reader's (the
store file read alone, 8 reads in flight: in the arm's own process just before its prefill and
just after its decode where it ran, ``arm --floor-seconds``, listed below the table; else the
hold's reader arm), the disk floor (MB per token / the reader's GB/s) and TPOT over it, TPOT over on-demand's (none), the mmap baseline's and
accelerate's TPOT over this arm's, and the cgroup's peak (RSS + page cache) against the cap.

Below it, per predicting or on-demand arm, the disk floor at both ends of the hold (the first and
the last reader run: the virtual disk's speed drifts within a hold) and TPOT over each, and where
the gap to the floor (TPOT - floor, mean reader) goes: ``idle`` = ms per token the disk read nothing
(compute no read overlapped: TPOT x (1 - the decode's disk busy share)) and ``slow`` = ms the reads
took beyond the floor (busy ms - floor: reads slower than the reader alone); idle + slow = gap.
``stall`` is the ms compute waited for reads, ``comp`` the experts' compute ms (both per token).
The last stdout line (--json) is one JSON object: hold -> arm -> those numbers ("gap": the second part).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows_by_hold(path: Path) -> dict[str, dict[str, dict]]:
    """hold -> arm -> its JSON line (the last one, where an arm ran twice; the reader's GB/s is the
    mean of its runs in the hold, e.g. one at each end, with each run in ``gbps_runs``)."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["arm"] == "reader" and "gbps" in row:
                runs = out[row["hold"]].get("reader", {}).get("gbps_runs", []) + [row["gbps"]]
                row = {**row, "gbps_runs": runs, "gbps": round(sum(runs) / len(runs), 3)}
            out[row["hold"]][row["arm"]] = row
    return dict(out)


def own_reader(row: dict) -> float | None:
    """The mean GB/s of the reader run in the arm's own process just before its prefill and just
    after its decode (disk_tier_bench.py arm --floor-seconds), or None when it did not run."""
    runs = [row[k] for k in ("reader_gbps_before", "reader_gbps_after") if row.get(k)]
    return round(sum(runs) / len(runs), 3) if runs else None


def numbers(arms: dict[str, dict]) -> dict[str, dict]:
    """arm -> the table's numbers (None where the hold lacks what a ratio needs). An arm's floor and
    reader share use the reader of its own process (own_reader) where it ran, else the reader arm's."""
    hold_reader = arms.get("reader", {}).get("gbps")
    none = arms.get("none", {}).get("tpot_ms")
    out = {}
    for name, row in arms.items():
        reader = own_reader(row) or hold_reader
        tpot, mb = row.get("tpot_ms"), row.get("decode_disk_mb_per_token")
        gbps = row.get("decode_disk_gbps")
        floor = mb / reader if mb and reader else None  # MB / (GB/s) = ms
        out[name] = {
            "round": row["round"], "tpot_ms": tpot, "mb_per_token": mb, "gbps": gbps or row.get("gbps"),
            "reader_share": round(gbps / reader, 2) if gbps and reader else None,
            "floor_ms": round(floor, 1) if floor else None,
            "x_floor": round(tpot / floor, 2) if tpot and floor else None,
            "x_none": round(tpot / none, 2) if tpot and none and name != "none" else None,
            "mmap_x": round(arms["mmap"]["tpot_ms"] / tpot, 2) if tpot and "mmap" in arms and name != "mmap" else None,
            "accel_x": (round(arms["accelerate"]["tpot_ms"] / tpot, 1)
                        if tpot and arms.get("accelerate", {}).get("tpot_ms") and name != "accelerate" else None),
            "own_reader": own_reader(row), "busy_share": row.get("decode_disk_busy_share"),
            "recall": row.get("recall"), "peak_mib": row["peak_mib"], "cap_mib": row["cap_mib"], "rc": row["rc"],
        }
    return out


def gap_numbers(arms: dict[str, dict]) -> dict[str, dict]:
    """arm -> floor at both ends, TPOT over each, and the gap's split (module docstring); arms with a
    decode (TPOT and disk MB per token) only."""
    runs = arms.get("reader", {}).get("gbps_runs", [])
    out = {}
    for name, row in arms.items():
        tpot, mb, busy = row.get("tpot_ms"), row.get("decode_disk_mb_per_token"), row.get("decode_disk_busy_share")
        if not (tpot and mb and runs) or name in ("mmap", "accelerate"):
            continue
        first, last, mean = mb / runs[0], mb / runs[-1], mb / (sum(runs) / len(runs))  # ms
        idle = tpot * (1 - busy) if busy is not None else None
        slow = tpot - idle - mean if idle is not None else None
        gap = tpot - mean
        out[name] = {"floor_first_ms": round(first, 1), "x_floor_first": round(tpot / first, 2),
                     "floor_last_ms": round(last, 1), "x_floor_last": round(tpot / last, 2), "gap_ms": round(gap, 1),
                     "idle_ms": None if idle is None else round(idle, 1),
                     "slow_ms": None if slow is None else round(slow, 1),
                     "idle_share": round(idle / gap, 2) if idle is not None and gap > 0 else None,
                     "stall_ms": row.get("disk_stall_ms_per_token"), "compute_ms": row.get("compute_ms_per_token")}
    return out


def _cell(v, width: int) -> str:
    text = "-" if v is None else (f"{v:.1f}" if isinstance(v, float) and abs(v) >= 100 else str(v))
    return text.rjust(width)


def render(holds: dict[str, dict[str, dict]]) -> str:
    """One 80-column block per hold."""
    cols = [("arm", 10), ("TPOT", 7), ("MB/tok", 7), ("GB/s", 6), ("rd sh", 5), ("floor", 6), ("xflr", 5),
            ("xnone", 5), ("mmap/", 5), ("acc/", 5), ("peak", 5)]
    lines = []
    for hold, arms in holds.items():
        table = numbers(arms)
        rounds = sorted({r["round"] for r in table.values()})
        cap = next(iter(table.values()))["cap_mib"]
        runs = arms.get("reader", {}).get("gbps_runs", [])
        lines.append(f"hold {hold} (round {', '.join(map(str, rounds))}; cap {cap} MiB; peak MiB; ms; reader "
                     f"GB/s {' '.join(map(str, runs)) or '-'})")
        lines.append(" ".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(cols)))
        for name, n in table.items():
            vals = [n["tpot_ms"], n["mb_per_token"], n["gbps"], n["reader_share"], n["floor_ms"], n["x_floor"],
                    n["x_none"], n["mmap_x"], n["accel_x"], n["peak_mib"]]
            flag = "" if n["rc"] == 0 else f"  rc {n['rc']}"
            lines.append(name.ljust(cols[0][1]) + " " + " ".join(_cell(v, w) for v, (_, w) in zip(vals, cols[1:])) + flag)
        own = [f"{name} {arms[name].get('reader_gbps_before', '-')}/{arms[name].get('reader_gbps_after', '-')}"
               for name, n in table.items() if n["own_reader"]]
        if own:
            text = "own reader GB/s (before/after): " + "; ".join(own)
            while text:
                cut = len(text) if len(text) <= 80 else text.rindex(" ", 0, 80)
                lines.append(text[:cut])
                text = text[cut:].lstrip()
        gaps = gap_numbers(arms)
        if gaps:
            gcols = [("arm", 10), ("flr0", 6), ("x0", 5), ("flr1", 6), ("x1", 5), ("gap", 6), ("idle", 6),
                     ("slow", 6), ("idl%", 5), ("stall", 6), ("comp", 6)]
            lines.append("floor at the hold's start (0) and end (1), the gap's split (ms per token)")
            lines.append(" ".join(n.ljust(w) if i == 0 else n.rjust(w) for i, (n, w) in enumerate(gcols)))
            for name, g in gaps.items():
                vals = [g["floor_first_ms"], g["x_floor_first"], g["floor_last_ms"], g["x_floor_last"], g["gap_ms"],
                        g["idle_ms"], g["slow_ms"], g["idle_share"], g["stall_ms"], g["compute_ms"]]
                lines.append(name.ljust(gcols[0][1]) + " " + " ".join(_cell(v, w) for v, (_, w) in zip(vals, gcols[1:])))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--json", action="store_true", help="the numbers as one JSON object on the last line")
    args = ap.parse_args()
    holds = rows_by_hold(args.path)
    print(render(holds))
    if args.json:
        print(json.dumps({h: {**numbers(a), "gap": gap_numbers(a)} for h, a in holds.items()}))


if __name__ == "__main__":
    main()
