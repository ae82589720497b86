"""Hit rate of every cache policy at 12.5 / 25 / 50 % of the experts, on held-out routing (issue 16).

Teacher-forces held-out text token by token through the default model (every expert resident, so
the routing is the model's own), records the routing of each decode step, then replays it through
the runtime's ExpertCache (runtime/cache/replay.py) for each policy and cache size: on-demand, with the
router predictor's predictions and with the oracle's (the true routing), under the cache's prefetch
rule. Prints a table (hit rate; first Belady's MIN, the offline bound, for each mode: runtime/cache/
belady.py; copies per token and wasted predictions at 25 %; the share of the lfru-MIN gap closed)
and one JSON line. Below the policies, on demand, two rules no
``--cache-policy`` runs: ``foresight`` (runtime/cache/foresight.py: the farthest expected next use
from the routers' rankings, what a running model knows) and MIN seeing only the next 1 / 2 / 4
tokens or 1 / 2 / 4 layer visits (belady.HorizonMinRule, lfru beyond: how much future the gap
needs); then the lookahead rule (runtime/cache/lookahead.py: lfru keeping the predicted top experts
of l+1 / l+2, or of the whole token from next-token rankings, with each ranking's recall).
``--save FILE`` writes the recorded trace (per decode step: routing, the router predictor's ids,
the routers' rankings (expert ids by logit, best first: the layer's own, the predictor's for the
next layer, router_{l+2} on r_l for the one after, and every router on the last token's final
hidden state and on the new token's embedding); the calibration seed; JSON) and ``--trace FILE`` replays a saved one without running the model
(``--calibration FILE``: with another calibration's seed). Usage:

  PYTHONPATH=$PWD python scripts/policy_hit_rates.py [--tokens 256] [--prompt 128] [--save F | --trace F]
      [--generate | --chat "Write a short story about a lighthouse keeper."]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch


def record(tokens: int, prompt: int, generate: bool = False, chat: str | None = None) -> dict:
    """Run the default model over held-out text; the trace as a JSON-ready dict.

    ``generate``: decode greedily after the prompt (what chat does) instead of teacher-forcing the
    text; ``chat``: the prompt is this user message in the model's chat template (implies generate).
    """
    from transformers import AutoTokenizer

    from moespec.config import CachePolicy, Predictor, RuntimeConfig
    from moespec.default_model import ensure_default_model
    from moespec.predict.base import RouterPredictor
    from moespec.profile.trace import load_text
    from moespec.runtime.cache.eviction import load_seed
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    torch.set_num_threads(1)
    path = ensure_default_model(None)
    # No prediction gate: with every expert resident nothing is copied, so the gate would stop the
    # router predicting after a few tokens and the trace would keep no predictions.
    om = load_offloaded(path, RuntimeConfig(device="cpu", predictor=Predictor.ROUTER, cache_policy=CachePolicy.LRU,
                                            prediction_gate=False))
    tok = AutoTokenizer.from_pretrained(path)
    text, _ = load_text(None)
    ids = tok(text)["input_ids"][: prompt + tokens]
    if chat is not None:
        templated = tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                            tokenize=False)
        ids, prompt, generate = tok(templated, add_special_tokens=False)["input_ids"], None, True
    engine = Engine(om)
    trace, preds, ranks, pred_ranks, far_ranks = [], [], [], [], []
    current: dict[int, list[int]] = {}
    current_ranks: dict[int, list[int]] = {}
    current_far: dict[int, list[int]] = {}

    class Recorded(RouterPredictor):
        """The router predictor, keeping what it predicts for each layer in ``current``, and the
        lookahead ranking of the layer after (router_{l+2}(LN_{l+2}(r_l))) in ``current_far``."""

        def predict(self, layer, residual, used):
            got = super().predict(layer, residual, used)
            if got is not None:
                target = self.target(layer)
                current.setdefault(target.layer, got.ids.reshape(-1).tolist())
                current_ranks.setdefault(target.layer, _ranked(got.logits))
                far = self.target(target.layer)
                if far is not None:
                    logits = self.adapter.router_logits(far.block, far.norm(residual))  # [1, E]
                    current_far.setdefault(far.layer, _ranked(logits))
            return got

    om.use_policy(replace(om.policy, predictor=Recorded(om.adapter, om.layer_refs())))
    # Next-token rankings, made before a token's first layer: every router on the last token's final
    # hidden state (the lm_head's input), and on the new token's embedding.
    final: dict[str, torch.Tensor] = {}
    hook = om.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: final.__setitem__("h", args[0][0, -1:].detach().clone()))  # [1, H]
    refs = om.layer_refs()

    def rank_all(state: torch.Tensor) -> dict[int, list[int]]:
        return {r.layer: _ranked(om.adapter.router_logits(r.block, r.norm(state))) for r in refs}

    next_final, next_embed = [], []
    with torch.inference_mode(), om.recording_routings() as ran:
        last = engine.forward(ids[:prompt], "prefill")
        for i in range(tokens):
            current, current_ranks, current_far = {}, {}, {}
            t = int(torch.argmax(last)) if generate else ids[prompt + i]
            next_final.append(rank_all(final.pop("h")))
            next_embed.append(rank_all(om.model.get_input_embeddings()(torch.tensor([t])).reshape(1, -1)))
            last = engine.forward([t], "decode")
            trace.append({layer: r.ids[0].tolist() for layer, r in sorted(ran.items())})
            ranks.append({layer: _ranked(r.logits) for layer, r in sorted(ran.items())})
            preds.append(current)
            pred_ranks.append(current_ranks)
            far_ranks.append(current_far)
    hook.remove()
    k = om.adapter.top_k()
    total = len(om.store.moe_layers) * om.store.num_experts
    seed = load_seed(path, None, k)
    om.close()
    assert all(len(step) == len(trace[0]) - 1 for step in preds), "the router predicted only some layers"
    return {"top_k": k, "experts": total, "trace": trace, "router": preds, "ranks": ranks,
            "router_ranks": pred_ranks, "lookahead_ranks": far_ranks,
            "next_final_ranks": next_final, "next_embed_ranks": next_embed, "seed": [[layer, e, p] for (layer, e), p in seed.items()]}


def _ranked(logits: torch.Tensor) -> list[int]:
    """Expert ids of a one-token router logits [1, E] (or [E]), highest logit first."""
    return torch.argsort(logits.reshape(-1).float(), descending=True, stable=True).tolist()


def _steps(raw: list) -> list[dict[int, list[int]]]:
    return [{int(layer): ids for layer, ids in step.items()} for step in raw]


def _row(rows: dict, name: str, mode: str, results: list, bound: list[float], base: dict) -> None:
    """Print and keep one policy's row: hit rates at each size, MIN's, copies and wasted at 25 %, and
    the share of the lfru-MIN gap closed (lfru's own row sets ``base``)."""
    rates = [r.hit_rate() for r in results]
    if name == "lfru":
        base[mode] = rates
    lf = base.get(mode, rates)
    closed = [(r - a) / (b - a) if b > a else float("nan") for r, a, b in zip(rates, lf, bound)]
    copies, wasted = results[1].copies_per_step(), results[1].wasted / results[1].steps
    rows[f"{name}/{mode}"] = {"hit_rate": rates, "min_hit_rate": bound, "gap_closed_vs_lfru": closed,
                              "copies_per_token_25": copies, "wasted_per_token_25": wasted}
    print(f"{name:>9} {mode:>9} " + " ".join(f"{r:5.3f}" for r in rates) + f"  {copies:6.1f} ({wasted:.1f})  "
          + " ".join("   -" if c != c else f"{c:4.0%}" for c in closed))  # -: MIN not above lfru (prefetch)


HORIZONS = (1, 2, 4)  # tokens of future routing a MIN row sees
VISITS = (1, 2, 4)  # layer visits of future routing a MIN row sees


def _truth(ids: list[int], experts: int) -> list[int]:
    """A ranking that puts a layer's true experts first (the oracle's ranking), then the rest."""
    return list(ids) + [e for e in range(experts) if e not in ids]


def main() -> None:
    from moespec.config import CachePolicy
    from moespec.runtime.cache.belady import BeladyRule, HorizonMinRule
    from moespec.runtime.cache.eviction import NEXT_TOKEN, LfruRule, make_rule
    from moespec.runtime.cache.foresight import ForesightRule
    from moespec.runtime.cache.lookahead import LookaheadRule
    from moespec.runtime.cache.replay import replay

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--generate", action="store_true", help="greedy decoding after the prompt, not the text")
    ap.add_argument("--chat", help="generate after this user message in the chat template")
    ap.add_argument("--save", type=Path, help="write the recorded trace here (JSON)")
    ap.add_argument("--trace", type=Path, help="replay this saved trace instead of running the model")
    ap.add_argument("--calibration", type=Path, help="seed the policies from this calibration file, not the "
                                                     "trace's recorded seed")
    args = ap.parse_args()
    data = json.loads(args.trace.read_text()) if args.trace else record(args.tokens, args.prompt, args.generate, args.chat)
    if args.save:
        args.save.write_text(json.dumps(data))
    trace, k, total = _steps(data["trace"]), data["top_k"], data["experts"]
    seed = {(layer, e): p for layer, e, p in data["seed"]}
    if args.calibration:
        from moespec.predict.calibration_file import load_calibration
        from moespec.runtime.cache.eviction import seed_from_frequencies

        calib = load_calibration(args.calibration)
        seed = seed_from_frequencies(list(calib.layers), calib.frequencies, k)
    modes = (("on-demand", None), ("router", _steps(data["router"])), ("oracle", trace))
    fracs = (0.125, 0.25, 0.5)
    sizes = [int(total * f) for f in fracs]

    ranks = _steps(data["ranks"]) if "ranks" in data else None  # traces saved before the rankings: none
    ahead = _steps(data["router_ranks"]) if "router_ranks" in data else None
    far = _steps(data["lookahead_ranks"]) if "lookahead_ranks" in data else None

    def run(rule, p, slots, ahead=ahead, far=far, nxt=None):
        return replay(trace, slots, rule, p, prefetch_slots=k if p else 0, ranks=ranks, predicted_ranks=ahead,
                      lookahead_ranks=far, next_token_ranks=nxt)

    bound = {mode: [run(partial(BeladyRule, trace), p, s).hit_rate() for s in sizes] for mode, p in modes}
    rows = {f"min/{mode}": {"hit_rate": rates} for mode, rates in bound.items()}
    print(f"{len(trace)} held-out tokens, {total} experts, top-{k}; min: Belady's MIN (offline bound)")
    head = " ".join(f"{f:>5.1%}" for f in fracs)
    print(f"{'policy':>9} {'mode':>9} {head}  copies@25%  lfru->MIN gap closed")
    for mode, rates in bound.items():
        print(f"{'min':>9} {mode:>9} " + " ".join(f"{r:5.3f}" for r in rates))
    base: dict[str, list[float]] = {}  # lfru's rates per mode
    for policy in CachePolicy:
        for mode, p in modes:
            results = [run(partial(make_rule, policy, seed, s, k), p, s) for s in sizes]
            _row(rows, policy.value, mode, results, bound[mode], base)
    # Rules no --cache-policy runs, on demand: foresight (the routers' rankings, foresight.py) and
    # MIN that sees only the next W tokens (belady.py), against lfru: what the gap needs.
    if ranks is not None:
        results = [run(partial(ForesightRule, seed, k), None, s) for s in sizes]
        _row(rows, "foresight", "on-demand", results, bound["on-demand"], base)
    for w in HORIZONS:
        results = [run(lambda w=w: HorizonMinRule(trace, w, LfruRule(seed, k)), None, s) for s in sizes]
        _row(rows, f"min@{w}tok", "on-demand", results, bound["on-demand"], base)
    # MIN seeing only the next V layer visits (the rest of lfru's order): what a lookahead could give.
    for v in VISITS:
        def horizon(v=v):
            rule = HorizonMinRule(trace, 0, LfruRule(seed, k))
            rule.window = v
            return rule
        results = [run(horizon, None, s) for s in sizes]
        _row(rows, f"min@{v}vis", "on-demand", results, bound["on-demand"], base)
    # The lookahead rule (lookahead.py): lfru keeping the router's top experts of the next layers,
    # from the router's rankings (distance 1, 2 or both) and from the true routing (an oracle ranking).
    if ahead is not None and far is not None:
        truth = [{layer: _truth(ids, total // len(step)) for layer, ids in step.items()} for step in trace]
        arms = [("look1", (1,), ahead, far), ("look2", (2,), ahead, far), ("look12", (1, 2), ahead, far),
                ("lookO12", (1, 2), truth, truth)]
        for name, dist, a, f in arms:
            for mode, p in modes[:2]:
                results = [run(partial(LookaheadRule, seed, k, distances=dist), p, s, a, f) for s in sizes]
                _row(rows, name, mode, results, bound[mode], base)
    # Next-token rankings (made before a token's first layer): every router on the last token's final
    # hidden state, on the new token's embedding, the last token's own routing, and the truth.
    if "next_final_ranks" in data:
        kinds = {"final": _steps(data["next_final_ranks"]), "embed": _steps(data["next_embed_ranks"]),
                 "last": [{}] + ranks[:-1], "truth": truth}
        for kind, nxt in kinds.items():
            got = [len(set(step[layer][:k]) & set(ids)) / k for s, step in enumerate(nxt) for layer, ids in trace[s].items()
                   if layer in step]
            print(f"next-token ranking {kind:>5}: recall@{k} {sum(got) / max(len(got), 1):.3f}")
            for protect in (k, 2 * k):
                name = f"nx{kind[0]}{protect}"
                rule = partial(LookaheadRule, seed, k, protect=protect, distances=(NEXT_TOKEN,))
                for mode, p in modes[:2]:
                    results = [run(rule, p, s, nxt=nxt) for s in sizes]
                    _row(rows, name, mode, results, bound[mode], base)
    print(json.dumps({"tokens": len(trace), "results": rows}))


if __name__ == "__main__":
    main()
