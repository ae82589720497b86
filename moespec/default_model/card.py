"""The model card (README.md) of the embedded default model: source, method, measured numbers."""

from __future__ import annotations

from moespec.data import CALIBRATION_DESCRIPTION, CHAT_CALIBRATION_DESCRIPTION, HELDOUT_DESCRIPTION
from moespec.default_model.convert import ConversionReport, MoeLayout
from moespec.default_model.gates import Answer


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def _experts_text(layout: MoeLayout) -> str:
    if layout.expert_neurons is None:
        return (f"The pool is partitioned into {layout.n_experts} routed experts of equal size by balanced k-means "
                "on the neurons' co-activation profiles (MoEfication, Zhang et al. 2022).")
    return (f"The calibration tokens' FFN inputs are clustered by direction into {layout.n_experts} balanced "
            f"groups; each token joins its {layout.top_k} nearest, and routed expert e takes the "
            f"{layout.expert_neurons} pool neurons whose mean contribution on its tokens is highest relative "
            "to their mean over all tokens. Experts may share neurons (each keeps its own copy and its own "
            "refitted down projection), so they specialise: routing matters, and each token's experts "
            "hold the pool neurons that matter for it.")


def _recorded_text(recorded: dict | None) -> str:
    """The test suite's measurements for this recipe, or a note that there are none yet."""
    if recorded is None:
        return ("The quality numbers of this recipe have not been recorded yet "
                "(`python scripts/default_model_gates.py --record` measures and records them).\n")
    return f"""Measured by moespec's test suite on a build of this same recipe and source (recipe digest
`{recorded['recipe_digest'][:16]}`); held-out text: {HELDOUT_DESCRIPTION};
{recorded['eval_tokens']} tokens, float32.

| quantity | value |
| --- | --- |
| dense perplexity | {recorded['dense_ppl']:.2f} |
| MoE perplexity (its own routing, = moespec `exact` mode) | {recorded['moe_ppl']:.2f} ({recorded['moe_over_dense']:.3f} x dense) |
| MoE perplexity, K random experts per token | {recorded['random_ppl']:.2f} ({recorded['random_over_moe']:.3f} x routed) |
| routed experts per layer E, per token K | {recorded['n_experts']}, {recorded['top_k']} |
| shared expert share of the FFN neurons | {recorded['shared_share']:.3f} |
| routed expert share of the FFN bytes | {recorded['routed_byte_share']:.3f} |

Targets the test suite checks: MoE perplexity at most 1.3 x dense; random routing at least
1.15 x the model's own; routed experts at least a quarter of the FFN bytes; 16 experts, top-4.
"""


def render_card(name: str, source: str, layout: MoeLayout, calib_tokens: int, recorded: dict | None,
                answers: list[Answer], conversion: ConversionReport, build_s: float,
                versions: dict[str, str]) -> str:
    """Markdown model card.

    Args:
        name: the model's folder name.
        source: where the dense weights came from (source.SOURCE_DESCRIPTION).
        layout: the conversion settings.
        calib_tokens: calibration tokens used.
        recorded: the test suite's measurements for this recipe (gates.recorded_gates()), or None.
        answers: this build's greedy answers to the short questions (gates.answer_questions).
        conversion: per-layer conversion report.
        build_s: wall time of this build in seconds (all of it, resumed parts included as run).
        versions: library versions, e.g. {"torch": "2.13.0"}.
    """
    layers = conversion.layers
    answer_rows = "\n".join(f"| {a.question} | {a.text!r} | {'yes' if a.correct else 'no'} |" for a in answers)
    per_layer = "\n".join(f"| {r.layer} | {r.recall:.3f} | {r.rel_err:.4f} | {r.random_rel_err:.4f} | "
                          f"{r.shared_only_rel_err:.4f} |" for r in layers)
    version_text = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
library_name: transformers
tags: [mixture-of-experts, moespec]
---
# {name}

A small real Mixture-of-Experts chat model built by moespec from a dense pretrained model, so that
`moespec chat` works out of the box and expert prediction and offloading can be measured on real
routing. It is a standard transformers `Qwen2MoeForCausalLM` checkpoint (float32 safetensors,
tokenizer and chat template included).

## Source
{source}. Licence: Apache-2.0 (this derived model keeps it).

## Method
Per layer, in order, on {calib_tokens} calibration tokens that flow through the already converted
layers ({CHAT_CALIBRATION_DESCRIPTION}; then {CALIBRATION_DESCRIPTION}):
1. The dense SwiGLU FFN (1536 neurons) is split by neurons: the {layout.shared_neurons} most important
   (mean |activation| x down-projection norm) form the shared expert; the other
   {1536 - layout.shared_neurons} are the routed pool. {_experts_text(layout)}
2. A bias-free linear router is fitted to pick, per token, the {layout.top_k} experts whose output
   removes the most error (least-squares start, then softmax cross-entropy by Adam on minibatches
   of {layout.router_batch} tokens drawn from all calibration tokens: measured, a router fitted on a
   4096-token subset reached 5% higher held-back layer error).
3. The down projections of the shared and routed experts are refitted by ridge least squares,
   given the router's choices and weights, to reproduce the dense FFN output; each token is
   weighted by 1 / ||dense FFN output||^2{"" if layout.relative_refit else " (off in this build)"}, so tokens with massive activations
   (attention sinks) do not capture the fit.
4. Qwen2-MoE mapping: softmax top-{layout.top_k} routing with renormalised weights
   (`norm_topk_prob`); shared_expert_gate weight 0, so sigmoid = 0.5 exactly, and the shared
   down projection doubled. Attention, norms and tied embeddings are copied unchanged.

Reproducible (fixed seeds, no sampling, every fit in float64: two builds agree to float32
rounding). This build took {build_s:.0f} s on this machine.

## Quality
{_recorded_text(None if recorded is None else recorded)}
This build's greedy answers (checked after every build):

| question | greedy answer | correct |
| --- | --- | --- |
{answer_rows}

Per layer, on held-back calibration tokens (errors: ||dense FFN - layer||^2 / ||dense FFN||^2;
mean recall {_mean([r.recall for r in layers]):.3f}, mean error {_mean([r.rel_err for r in layers]):.4f}):

| layer | router recall vs oracle | error | error, random routing | error, shared expert only |
| --- | --- | --- | --- | --- |
{per_layer}

Built with {version_text}.
"""
