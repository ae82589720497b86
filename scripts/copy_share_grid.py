"""Issue 29's copy-share grid: every predictor against on-demand at stated copy shares, cache sizes, policies.

Each cell is one ``moespec profile --device cpu --copy-share S --cache-experts N --cache-policy P``
run (its unthrottled on-demand probe sets the emulated link so on-demand copies are S of on-demand
TPOT; every strategy of the cell then runs on the same token trace in the same process, so the
ratios of a cell are paired). A cell's report is written to OUT_DIR/s<S>_c<N>_<P>.json; a cell
whose report exists is not run again, so the grid can be split into several ``cpulock ex`` holds
(one per call, at most 8 minutes each) and the table printed once all have run:

  cpulock ex python scripts/copy_share_grid.py --shares 0.75 --sizes 120 --policies lru,lfru
  python scripts/copy_share_grid.py --table-only

Prints one row per cell (80 columns): the share asked and reached by the timed on-demand run,
on-demand TPOT (ms), each predictor's TPOT / on-demand, H2D MB per token of on-demand and of the
oracle, and the must-holds that fail there ("T": a predictor slower than on-demand, "B": the oracle
moved more bytes). The last line is one JSON object: every cell's numbers and the must-holds
(every predictor <= 1.00x and oracle bytes <= on-demand's in every cell; at 0.75 and 120 slots
(25 % of the default model's 480 experts) the best predictor but the oracle <= 0.85x).
lfru/lfu need the calibration file (`moespec calibrate smollm2-135m-moe-e16k4`); without it
profile falls back to lru, so a cell whose report names another policy is flagged "P".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TPOT_BOUND = 1.00  # every predictor's TPOT / on-demand, every cell
BEST_BOUND = 0.85  # the best predictor (not the oracle) at BEST_CELL
BEST_CELL = (0.75, 120)  # (share, slots): 25 % of 480 experts


def cell_path(out_dir: Path, share: float, slots: int, policy: str) -> Path:
    """Where a cell's profile report lives."""
    return out_dir / f"s{share:g}_c{slots}_{policy}.json"


def run_cell(out_dir: Path, share: float, slots: int, policy: str, args) -> None:
    """One ``moespec profile`` run for the cell (skipped when its report exists)."""
    out = cell_path(out_dir, share, slots, policy)
    if out.exists():
        return
    cmd = [sys.executable, "-m", "moespec", "profile", "--device", "cpu", "--threads", "1",
           "--strategies", args.strategies, "--cache-experts", str(slots), "--cache-policy", policy,
           "--copy-share", str(share), "--prompt-len", str(args.prompt), "--gen", str(args.gen),
           "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--out", str(out), "--force"]
    print(f"cell share {share:g}, {slots} slots, {policy}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def summarise(report: dict, asked_policy: str) -> dict:
    """One cell's numbers from its profile report (run asking for ``asked_policy``): ratios vs none,
    MB/token, failed must-holds."""
    res = {r["strategy"]: r for r in report["results"]}
    none = res["none"]
    share = report["copy_share"]
    opts = report["options"]
    preds = {n: r["tpot_ms"]["mean"] / none["tpot_ms"]["mean"] for n, r in res.items() if n != "none"}
    mb = {n: r["h2d_bytes_per_token"] / 1e6 for n, r in res.items()}
    fails = []
    if any(x > TPOT_BOUND for x in preds.values()):
        fails.append("T")
    if "oracle" in res and res["oracle"]["h2d_bytes_per_token"] > none["h2d_bytes_per_token"]:
        fails.append("B")
    if opts["cache_policy"] != asked_policy:
        fails.append("P")
    return {"share": share["asked"], "reached": next(iter(share["reached"].values()), None),
            "slots": opts["cache_experts"], "policy": opts["cache_policy"], "none_ms": none["tpot_ms"]["mean"],
            "ratio": preds, "mb_per_token": mb, "hit_rate": {n: r["hit_rate"] for n, r in res.items()},
            "fails": fails}


def best_predictor(cell: dict) -> tuple[str, float] | None:
    """The fastest predictor of a cell but the oracle (an upper bound, not a predictor one can run)."""
    real = {n: x for n, x in cell["ratio"].items() if not n.startswith("oracle")}
    return min(real.items(), key=lambda kv: kv[1]) if real else None


def table(cells: list[dict], names: list[str]) -> list[str]:
    """Rows of at most 80 columns: share (reached), slots, policy, none ms, each ratio, MB none/oracle."""
    head = f"{'share':>10} {'slots':>5} {'pol':>4} {'none ms':>7}" + "".join(f" {n[:6]:>6}" for n in names)
    head += f" {'MB none':>7} {'oracle':>6} fail"
    lines = [head]
    for c in cells:
        reached = "-" if c["reached"] is None else f"{c['reached']:.2f}"
        row = f"{c['share']:>4g} ({reached:>4}) {c['slots']:>5} {c['policy']:>4} {c['none_ms']:>7.1f}"
        row += "".join(f" {c['ratio'][n]:>6.3f}" if n in c["ratio"] else f" {'-':>6}" for n in names)
        mb = c["mb_per_token"]
        row += f" {mb['none']:>7.2f} {mb.get('oracle', float('nan')):>6.2f} {''.join(c['fails']) or 'ok'}"
        lines.append(row)
    return lines


def verdict(cells: list[dict]) -> dict:
    """The issue's must-holds over the cells that ran."""
    best = [(c, best_predictor(c)) for c in cells if (c["share"], c["slots"]) == BEST_CELL]
    return {"every_predictor_le_1": all("T" not in c["fails"] for c in cells),
            "oracle_bytes_le_none": all("B" not in c["fails"] for c in cells),
            "best_at_0.75_25pct": {c["policy"]: b for c, b in best if b is not None},
            "best_le_0.85": all(b[1] <= BEST_BOUND for _, b in best if b is not None) if best else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="0.25,0.5,0.75,0.9")
    ap.add_argument("--sizes", default="8,60,120,240", help="cache slots (480 experts: 12.5/25/50 %% = 60/120/240)")
    ap.add_argument("--policies", default="lru,lfru")
    ap.add_argument("--strategies", default="none,router,quasi,oracle")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default="/tmp/moespec-copy-share-grid")
    ap.add_argument("--table-only", action="store_true", help="print the table of the reports in --out-dir")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for share in (float(s) for s in args.shares.split(",")):
            for slots in (int(n) for n in args.sizes.split(",")):
                for policy in args.policies.split(","):
                    run_cell(out_dir, share, slots, policy, args)
    cells = sorted((summarise(json.loads(p.read_text()), p.stem.rsplit("_", 1)[1])
                    for p in out_dir.glob("s*_c*_*.json")),
                   key=lambda c: (c["share"], c["slots"], c["policy"]))
    names = sorted({n for c in cells for n in c["ratio"]}, key=lambda n: (n.startswith("oracle"), n))
    print("\n".join(table(cells, names)))
    print(json.dumps({"cells": cells, **verdict(cells)}))


if __name__ == "__main__":
    main()
