"""Start cost of ``--compile on``: wall seconds of whole chat processes, compiled against eager.

    python scripts/compile_start.py [MODEL] [--rounds 1] [--tokens 8] [--threads 1]

Each round runs, one after another: an eager start (``--compile off``), a compiled start on a new,
empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh folder: the first start), a compiled start
on that same folder (the second start), and an eager start again. Every start is the whole
``moespec chat MODEL --prompt hi --max-new-tokens N --threads T --json`` process (import, load,
prefill, N tokens), so "extra" is what a user waits for more: compiled wall minus the mean of the
two eager walls around it. Last stdout line: one JSON object.
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


def start(model: str | None, compile_mode: str, tokens: int, threads: int, cache: str) -> float:
    """Wall seconds of one chat process (raises CalledProcessError when it fails)."""
    cmd = [sys.executable, "-m", "moespec", "chat", *([model] if model else []), "--prompt", "hi",
           "--max-new-tokens", str(tokens), "--threads", str(threads), "--compile", compile_mode, "--json"]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="compile-start-") as cache:
            walls = {}
            for name, mode in (("off", "off"), ("first", "on"), ("second", "on"), ("off_after", "off")):
                walls[name] = start(args.model, mode, args.tokens, args.threads, cache)
                print(f"round {r} {name}: {walls[name]:.1f} s", flush=True)
            eager = (walls["off"] + walls["off_after"]) / 2
            rows.append({**walls, "first_extra": walls["first"] - eager, "second_extra": walls["second"] - eager})
    summary = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(json.dumps({"model": args.model, "tokens": args.tokens, "threads": args.threads, "rows": rows,
                      "median": summary}))


if __name__ == "__main__":
    main()
