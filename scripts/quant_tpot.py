"""Zero-cache TPOT and recall of int4 (or int8) experts against float32, at a link where float32 copies
are a chosen share of on-demand TPOT, alternating in one run.

    python scripts/quant_tpot.py [--rounds 3] [--expert-dtype int4] [--copy-share 0.75] [--calibration F] [MODEL]
    python scripts/quant_tpot.py --link-gbps 0.06     # a fixed link instead of finding one

Finding the link: one float32 run of strategy `none` on an unthrottled link gives, per decode token,
the compute time C (each layer's wall time minus its copy stall, + the time outside the layers) and
the bytes moved B (`moespec profile`'s bounds). On-demand TPOT at a link of R GB/s is C + B/R, so
float32 copies are a share s of it at R = B / (C * s / (1 - s)). Every float32 run then reports the
share it measured (`bounds.copy_share`: copy time of the needed bytes at the measured link / the
on-demand bound), so the share is a measurement, not only the target.

Each round runs `moespec profile` twice back to back on the same deterministic trace, float32
experts then quantised experts (--cache-experts 8 = 2K slots on the default model, so nothing
stays cached across tokens; strategies none, router, quasi). Because the machine is shared, the
ratio is taken within each round (adjacent runs) and reported as min / median over rounds, with
each side's compute per token (the quantised side's extra compute is dequantisation after the copy).
Last stdout line: one JSON object.
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


def _profile(model: list[str], out: Path, args, expert_dtype: str, link_gbps: float | None,
             strategies: str = "none,router,quasi", gen: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "moespec", "profile", *model, "--strategies", strategies,
           "--cache-experts", "8", "--prompt-len", str(args.prompt_len),
           "--gen", str(gen or args.gen), "--repeats", str(args.repeats), "--warmup", "2", "--device", "cpu",
           "--threads", "1", "--expert-dtype", expert_dtype, "--out", str(out), "--force"]
    if link_gbps:
        cmd += ["--link-gbps", f"{link_gbps:.4f}"]
    if args.calibration:
        cmd += ["--calibration", args.calibration]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {r["strategy"]: r for r in report["results"]} | {"_model": report["model"]}


def find_link(model: list[str], tmp: Path, args) -> dict:
    """The link (GB/s) at which float32 copies are ``args.copy_share`` of on-demand TPOT (see module doc)."""
    r = _profile(model, tmp / "probe.json", args, "auto", None, "none")["none"]
    compute_ms, bytes_per_token = r["bounds"]["compute_ms"], r["h2d_bytes_per_token"]
    copy_ms = compute_ms * args.copy_share / (1 - args.copy_share)
    link = bytes_per_token / (copy_ms * 1e-3) / 1e9
    print(f"probe (unthrottled): compute {compute_ms:.0f} ms/token, {bytes_per_token / 1e6:.1f} MB/token "
          f"-> --link-gbps {link:.4f} for a {args.copy_share:.0%} copy share", file=sys.stderr)
    return {"compute_ms": compute_ms, "h2d_bytes_per_token": bytes_per_token,
            "tpot_ms": r["tpot_ms"]["mean"], "link_gbps": link}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--expert-dtype", default="int4")
    parser.add_argument("--copy-share", type=float, default=0.75, help="target float32 copy share of TPOT")
    parser.add_argument("--link-gbps", type=float, default=None, help="a fixed link (skips finding one)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calibration", default=None, help="calibration file for quasi (default: MODEL's)")
    args = parser.parse_args()
    model = [args.model] if args.model else []
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = None if args.link_gbps else find_link(model, Path(tmp), args)
        link = args.link_gbps or probe["link_gbps"]
        for k in range(args.rounds):
            f32 = _profile(model, Path(tmp) / "f32.json", args, "auto", link)
            low = _profile(model, Path(tmp) / "low.json", args, args.expert_dtype, link)
            row = {"round": k, "float32_expert_bytes": f32["_model"]["expert_bytes"],
                   "quant_expert_bytes": low["_model"]["expert_bytes"]}
            for s in ("none", "router", "quasi"):
                row[f"{s}_tpot_ms"] = [f32[s]["tpot_ms"]["mean"], low[s]["tpot_ms"]["mean"]]
                row[f"{s}_tpot_ratio"] = low[s]["tpot_ms"]["mean"] / f32[s]["tpot_ms"]["mean"]
                row[f"{s}_copy_share_float32"] = f32[s]["bounds"].get("copy_share")
                row[f"{s}_compute_ms"] = [f32[s]["bounds"]["compute_ms"], low[s]["bounds"]["compute_ms"]]
                if s != "none":
                    row[f"{s}_recall"] = [f32[s]["recall"], low[s]["recall"]]
                    row[f"{s}_recall_delta"] = low[s]["recall"] - f32[s]["recall"]
            rounds.append(row)
            print(f"round {k}: none {row['none_tpot_ms'][0]:.0f} -> {row['none_tpot_ms'][1]:.0f} ms "
                  f"({row['none_tpot_ratio']:.3f}x; float32 copies {row['none_copy_share_float32']:.0%}; compute "
                  f"{row['none_compute_ms'][0]:.0f} -> {row['none_compute_ms'][1]:.0f} ms); router "
                  f"{row['router_tpot_ratio']:.3f}x, quasi {row['quasi_tpot_ratio']:.3f}x; recall delta router "
                  f"{row['router_recall_delta']:+.4f} quasi {row['quasi_recall_delta']:+.4f}", file=sys.stderr)
    summary = {}
    for key in ("none_tpot_ratio", "router_tpot_ratio", "quasi_tpot_ratio", "router_recall_delta",
                "quasi_recall_delta", "none_copy_share_float32"):
        values = [r[key] for r in rounds]
        summary[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    ok = (summary["none_tpot_ratio"]["median"] <= 0.45
          and all(abs(r[k]) <= 0.02 for r in rounds for k in ("router_recall_delta", "quasi_recall_delta")))
    print(json.dumps({"expert_dtype": args.expert_dtype, "link_gbps": link, "target_copy_share": args.copy_share,
                      "probe": probe, "threads": 1, "host": os.uname().nodename, "rounds": rounds,
                      "summary": summary, "pass": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
