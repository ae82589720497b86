"""Guarded mode's variants on one model load: rule (threshold / budget) x substitution (best
resident by router logit / none), each as exact + one arm per τ on held-out text (issue 16).

Each variant is one `moespec profile --execute guarded --decode-inputs text` run (profile/run.py):
the same prompt and teacher-forced held-out tokens, the exact arm as reference. Prints the guarded-
vs-exact table per variant and one JSON line per variant (τ -> bytes saved, top-1, ppl ratio, KL).

  PYTHONPATH=$PWD python scripts/guard_variants.py --cache-experts 120 --gen 256 \
      --taus 0.02,0.05,0.1,0.2,0.3 [--calibration FILE] [--link-gbps 0.09]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch


def main() -> None:
    from rich.console import Console

    from moespec.cli.runtime_opts import threshold_list
    from moespec.config import ExecuteMode, GuardRule, Predictor, RuntimeConfig
    from moespec.default_model import ensure_default_model
    from moespec.predict.base import NoPredictor
    from moespec.profile.guard_view import guard_tables
    from moespec.profile.report import build_report, describe
    from moespec.profile.run import ProfileConfig, run_profile
    from moespec.profile.strategy import Strategy, guard_arms
    from moespec.profile.trace import DecodeInputs
    from moespec.runtime.load import load_offloaded

    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-experts", type=int, default=120)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--taus", default="0.02,0.05,0.1,0.2,0.3")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded default model)")
    ap.add_argument("--variants", default="threshold+sub,budget+sub,threshold+drop,budget+drop")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = args.model or ensure_default_model(None)
    cfg = RuntimeConfig(device="cpu", cache_experts=args.cache_experts, predictor=Predictor.NONE,
                        execute=ExecuteMode.GUARDED, link_gbps=args.link_gbps, calibration_path=args.calibration)
    om = load_offloaded(path, cfg)
    console = Console(width=80)
    try:
        for note in om.notes:
            console.print(f"note: {note}", markup=False)
        refs = om.layer_refs()
        arms = guard_arms((Strategy(Predictor.NONE),), threshold_list(args.taus))
        pcfg = ProfileConfig(strategies=arms, prompt_lens=(args.prompt_len,), gen=args.gen, repeats=1,
                             warmup_steps=0, execute=ExecuteMode.GUARDED, decode_inputs=DecodeInputs.TEXT)
        none = NoPredictor(om.adapter, refs)
        for variant in args.variants.split(","):
            rule, _, sub = variant.partition("+")
            om.use_policy(replace(om.policy, guard_rule=GuardRule(rule), guard_substitute=sub == "sub"))
            prof = run_profile(om, _tokenizer(path), pcfg, {a.name: none for a in arms})
            rep = build_report(describe(om, "default"), {"cache_policy": om.cache.policy.value}, pcfg, prof)
            console.print(f"[bold]{variant}[/] (cache {om.cache.num_slots}, policy {om.cache.policy.value})")
            for table in guard_tables(rep, args.prompt_len, 80):
                console.print(table)
            print(json.dumps({"variant": variant, "arms": {
                r["strategy"]: {"mb_per_token": r["h2d_bytes_per_token"] / 1e6,
                                "bytes_saved": (r["vs_exact"] or {}).get("bytes_saved"),
                                "top1": r["quality"]["top1_agreement"], "ppl": r["quality"]["perplexity"],
                                "ppl_ratio": (r["vs_exact"] or {}).get("perplexity_ratio"),
                                "kl": r["quality"]["kl_mean"], "skipped_mass_per_token": r["skipped_mass_per_token"]}
                for r in rep["results"]}}), flush=True)
    finally:
        om.close()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    main()
