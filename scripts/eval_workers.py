"""`moespec eval --workers 1` vs `--workers N`: whole-command wall time, paired and interleaved.

    python scripts/eval_workers.py --workers 1,2 --rounds 1 -- \\
        --arms exact,speculative:router,speculative:hybrid,guarded:router --tasks arc_easy,gsm8k \\
        --limit 6,gsm8k=2 --max-gen-toks 128 --cache-experts 120 --threads 1

Everything after ``--`` goes to `moespec eval` as it is; each run writes into its own fresh --out
folder. Per run: the command's wall seconds (model load included: what a user waits for), and per
arm the generated tokens of generation tasks (each record's ``tokens``). Then the ratio of the
medians, and between the runs the largest log-likelihood difference and the generated texts that
differ, per arm (guarded included: eval runs it without the timed gate, so it must match too).
Quote the figures only from a run under the machine's exclusive CPU lock. The last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _records(out: Path) -> dict:
    """arm name -> task -> doc_id -> record, from the per-arm files in ``out``."""
    got = {}
    for p in sorted(out.glob("*.json")):
        if p.name.startswith(("results-", "summary")):
            continue
        data = json.loads(p.read_text())
        got[p.stem] = {t: e["items"] for t, e in data["tasks"].items()}
    return got


def _compare(a: dict, b: dict) -> dict:
    """Per arm: the largest |Δ log-likelihood| and how many generated texts differ between two runs."""
    out = {}
    for arm, tasks in a.items():
        worst, texts = 0.0, 0
        for task, items in tasks.items():
            for doc, rec in items.items():
                other = b.get(arm, {}).get(task, {}).get(doc)
                if other is None:
                    continue
                if "logprobs" in rec:
                    worst = max([worst] + [abs(x - y) for x, y in zip(rec["logprobs"], other["logprobs"])])
                else:
                    texts += rec["text"] != other["text"]
        out[arm] = {"max_abs_logprob_diff": worst, "texts_differ": texts}
    return out


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    counts = [int(w) for w in args.workers.split(",")]
    walls: dict[int, list[float]] = {w: [] for w in counts}
    runs = []
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for w in (counts if r % 2 == 0 else counts[::-1]):
                out = Path(tmp) / f"r{r}-w{w}"
                cmd = [sys.executable, "-m", "moespec", "eval", *rest, "--workers", str(w), "--out", str(out)]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if done.returncode:
                    sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
                walls[w].append(wall)
                recs = _records(out)
                tokens = {arm: {t: sum(rec.get("tokens", 0) for rec in items.values())
                                for t, items in tasks.items() if any("tokens" in x for x in items.values())}
                          for arm, tasks in recs.items()}
                line = [ln for ln in done.stdout.splitlines() if "wall time" in ln]
                print(f"round {r} workers {w}: {wall:.1f} s  {line[-1].strip() if line else ''}")
                print(f"  generated tokens per arm: {tokens}")
                runs.append({"round": r, "workers": w, "wall_s": wall, "tokens": tokens, "records": recs})
        med = {w: statistics.median(v) for w, v in walls.items()}
        base = counts[0]
        ratios = {w: med[w] / med[base] for w in counts}
        first = {w: next(x for x in runs if x["workers"] == w) for w in counts}
        diffs = {w: _compare(first[base]["records"], first[w]["records"]) for w in counts[1:]}
        for w in counts[1:]:
            print(f"median wall workers {w} / workers {base}: {ratios[w]:.3f}  ({med[w]:.1f} s vs {med[base]:.1f} s)")
            print(f"  records vs workers {base}: {diffs[w]}")
    print(json.dumps({"walls_s": walls, "ratio_to_first": ratios, "diffs": diffs,
                      "tokens": {f"r{x['round']}-w{x['workers']}": x["tokens"] for x in runs}, "args": rest}))


if __name__ == "__main__":
    main()
