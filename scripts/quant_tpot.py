"""Zero-cache TPOT and recall of int4 (or int8) experts against float32, alternating in one run.

    python scripts/quant_tpot.py [--rounds 3] [--expert-dtype int4] [--link-gbps 0.09] [--calibration F] [MODEL]

Each round runs `moespec profile` twice back to back on the same deterministic trace, float32
experts then quantised experts (--cache-experts 8 = 2K slots on the default model, so nothing
stays cached across tokens; --link-gbps chosen so float32 copies are ~75 % of on-demand TPOT;
strategies none, router, quasi). Because the machine is shared, the ratio is taken within each
round (adjacent runs) and reported as min / median over rounds. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _profile(model: list[str], out: Path, args, expert_dtype: str) -> dict:
    cmd = [sys.executable, "-m", "moespec", "profile", *model, "--strategies", "none,router,quasi",
           "--cache-experts", "8", "--link-gbps", str(args.link_gbps), "--prompt-len", str(args.prompt_len),
           "--gen", str(args.gen), "--repeats", str(args.repeats), "--warmup", "2", "--device", "cpu",
           "--threads", "1", "--expert-dtype", expert_dtype, "--out", str(out), "--force"]
    if args.calibration:
        cmd += ["--calibration", args.calibration]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {r["strategy"]: r for r in report["results"]} | {"_model": report["model"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--expert-dtype", default="int4")
    parser.add_argument("--link-gbps", type=float, default=0.09)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calibration", default=None, help="calibration file for quasi (default: MODEL's)")
    args = parser.parse_args()
    model = [args.model] if args.model else []
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            f32 = _profile(model, Path(tmp) / "f32.json", args, "auto")
            low = _profile(model, Path(tmp) / "low.json", args, args.expert_dtype)
            row = {"round": k, "float32_expert_bytes": f32["_model"]["expert_bytes"],
                   "quant_expert_bytes": low["_model"]["expert_bytes"]}
            for s in ("none", "router", "quasi"):
                row[f"{s}_tpot_ms"] = [f32[s]["tpot_ms"]["mean"], low[s]["tpot_ms"]["mean"]]
                row[f"{s}_tpot_ratio"] = low[s]["tpot_ms"]["mean"] / f32[s]["tpot_ms"]["mean"]
                row[f"{s}_copy_share_float32"] = f32[s]["bounds"].get("copy_share")
                if s != "none":
                    row[f"{s}_recall"] = [f32[s]["recall"], low[s]["recall"]]
                    row[f"{s}_recall_delta"] = low[s]["recall"] - f32[s]["recall"]
            rounds.append(row)
            print(f"round {k}: none {row['none_tpot_ms'][0]:.0f} -> {row['none_tpot_ms'][1]:.0f} ms "
                  f"({row['none_tpot_ratio']:.3f}x); router {row['router_tpot_ratio']:.3f}x, quasi "
                  f"{row['quasi_tpot_ratio']:.3f}x; recall delta router {row['router_recall_delta']:+.4f} "
                  f"quasi {row['quasi_recall_delta']:+.4f}", file=sys.stderr)
    summary = {}
    for key in ("none_tpot_ratio", "router_tpot_ratio", "quasi_tpot_ratio", "router_recall_delta",
                "quasi_recall_delta"):
        values = [r[key] for r in rounds]
        summary[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    ok = (summary["none_tpot_ratio"]["median"] <= 0.45
          and all(abs(r[k]) <= 0.02 for r in rounds for k in ("router_recall_delta", "quasi_recall_delta")))
    print(json.dumps({"expert_dtype": args.expert_dtype, "link_gbps": args.link_gbps, "threads": 1,
                      "host": os.uname().nodename, "rounds": rounds, "summary": summary, "pass": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
