"""Recall@K of the next token's first MoE layer(s), predicted across the token boundary (issue 29).

Runs the default model (every expert resident, so the routing is the model's own) over a prompt and
then greedy generation (``--generate``, what chat does) or the held-out text after it, and scores, at
every decode step, what could predict the first MoE layer's experts of the new token before its
layer 0 runs:

  last     the previous token's own first-layer set (temporal locality; known a whole token early)
  freq     the calibrated frequencies' top K of that layer (the calibration file; else the prompt's)
  final    router_0(LN_0(h)), h the previous token's final hidden state (the lm_head's input: known
           before the token is sampled)
  embed    router_0(LN_0(e)), e the new token's embedding (known once it is sampled)
  embed+a  router_0(LN_0(e + a_0)), a_0 the mean layer-0 attention output r_0 - e over the prompt
           (the quasi-hidden state's default vector for the attention part, measured in the prefill)

For each: recall@K (|predicted top K ∩ true| / K) and recall of the top 2K, at the first MoE layer and,
for the token-known candidates, at the second (router_1 on the same state). Prints one line per
candidate and one JSON line.

  PYTHONPATH=$PWD python scripts/next_token_recall.py [--prompt 128] [--tokens 128] [--generate]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--generate", action="store_true", help="greedy generation after the prompt")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from moespec.config import Predictor, RuntimeConfig
    from moespec.default_model import ensure_default_model
    from moespec.errors import MoespecError
    from moespec.profile.trace import load_text
    from moespec.runtime.cache.eviction import load_seed
    from moespec.runtime.engine import Engine
    from moespec.runtime.layer.observer import Observer
    from moespec.runtime.load import load_offloaded

    torch.set_num_threads(1)
    path = ensure_default_model(None)
    om = load_offloaded(path, RuntimeConfig(device="cpu", predictor=Predictor.NONE))
    tok = AutoTokenizer.from_pretrained(path)
    text, _ = load_text(None)
    ids = tok(text)["input_ids"][: args.prompt + args.tokens + 1]
    refs = om.layer_refs()
    first, second = refs[0], refs[1]
    k = om.adapter.top_k()
    embed = om.model.get_input_embeddings()

    class Log(Observer):
        def __init__(self):
            self.ids, self.r0 = {}, None

        def routing(self, layer, x, residual, routing):
            self.ids[layer] = routing.ids.reshape(-1, k)[-1].tolist()
            if layer == first.layer and residual is not None:
                self.r0 = residual.reshape(-1, residual.shape[-1]).detach().clone()  # [T, H]

    final = {}
    hook = om.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, a: final.__setitem__("h", a[0][0, -1:].detach().clone()))  # [1, H]

    def ranked(ref, state):
        return om.adapter.router_logits(ref.block, ref.norm(state)).reshape(-1).argsort(descending=True).tolist()

    try:
        seed = load_seed(path, None, k)
    except MoespecError:  # no calibration file yet: the prompt's frequencies stand in
        seed = {}
    freq_rank = sorted(range(om.store.num_experts), key=lambda e: -seed.get((first.layer, e), 0.0))
    log = Log()
    engine = Engine(om)
    scores: dict[str, list[tuple[float, float]]] = {}

    def score(name, rank, true):
        scores.setdefault(name, []).append((len(set(rank[:k]) & set(true)) / k, len(set(rank[:2 * k]) & set(true)) / k))

    with torch.inference_mode(), om.observing(log):
        last = engine.forward(ids[: args.prompt], "prefill")
        e_prompt = embed(torch.tensor(ids[: args.prompt])).reshape(args.prompt, -1).float()
        a0 = (log.r0.float() - e_prompt).mean(dim=0, keepdim=True)  # [1, H]
        prompt_counts = {}
        prev = log.ids[first.layer]
        for i in range(args.tokens):
            t = int(torch.argmax(last)) if args.generate else ids[args.prompt + i]
            h = final.pop("h")
            e = embed(torch.tensor([t])).reshape(1, -1)
            cand = {"final": (ranked(first, h), ranked(second, h)), "embed": (ranked(first, e), ranked(second, e)),
                    "embed+a": (ranked(first, (e.float() + a0).to(e.dtype)), ranked(second, (e.float() + a0).to(e.dtype)))}
            if not seed:
                freq_rank = sorted(range(om.store.num_experts), key=lambda x: -prompt_counts.get(x, 0))
            log.ids = {}
            last = engine.forward([t], "decode")
            true0, true1 = log.ids[first.layer], log.ids[second.layer]
            score("last", prev, true0)
            score("freq", freq_rank, true0)
            for name, (r0, r1) in cand.items():
                score(name, r0, true0)
                score(name + " L1", r1, true1)
            for x in true0:
                prompt_counts[x] = prompt_counts.get(x, 0) + 1
            prev = true0
    hook.remove()
    om.close()
    out = {}
    for name, got in scores.items():
        r1 = sum(a for a, _ in got) / len(got)
        r2 = sum(b for _, b in got) / len(got)
        out[name] = {"recall_k": round(r1, 3), "recall_2k": round(r2, 3)}
        print(f"{name:>10}: recall@{k} {r1:.3f}  recall@{2 * k} {r2:.3f}")
    print(json.dumps({"tokens": args.tokens, "generate": args.generate, "seeded": bool(seed), "results": out}))


if __name__ == "__main__":
    main()
