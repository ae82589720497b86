"""Convert a dense Llama-family model (SmolLM2) into a Qwen2-MoE model, layer by layer.

Per layer l, on calibration tokens flowing through the *already converted* layers 0..l-1
(so each router is fitted on the inputs it will see, as in GPTQ-style sequential methods):
1. run layer l's attention to get r_l and the FFN input s_l = post_attention_layernorm(r_l);
2. split the dense FFN's neurons into a shared expert and E routed experts specialised to token
   clusters (split.py; experts may share neurons);
3. fit the router on s_l (router_fit.py), then refit all down projections by ridge least
   squares given the router's choices and weights (refit.py);
4. write the Qwen2-MoE block: shared expert with its down projection times 2 and a zero
   shared_expert_gate (sigmoid(0) = 0.5 exactly), routed experts, the fitted router;
5. advance the hidden states through the converted block.

Attention, norms and embeddings are copied unchanged; Qwen2-MoE attention with qkv_bias=False
and no sliding window is Llama attention. Word embeddings stay tied to the LM head.

Shapes: N calibration sequences of S tokens, T = N*S, H hidden, I dense intermediate,
E routed experts, K experts per token, I_e neurons per routed expert.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from moespec.default_model.refit import moe_features, refit_down_routed, relative_error
from moespec.default_model.router_fit import fit_router, oracle_topk_factored, topk_weights
from moespec.default_model.split import cluster_experts, split_neurons


WORK_DTYPE = torch.float64  # every fit: split, oracle, router, down-projection refit (see convert())
STREAM_DTYPE = torch.float32  # the calibration forward: attention, activations, targets, outputs


@dataclass(frozen=True)
class MoeLayout:
    """How the dense FFNs become experts and how the routers are fitted.

    Attributes:
        n_experts: routed experts per layer (E).
        top_k: routed experts per token (K).
        shared_neurons: dense neurons kept in the always-on shared expert.
        expert_neurons: I_e, neurons per routed expert, taken by split.cluster_experts (experts
            specialised to token clusters, may overlap); None partitions the pool instead
            (split.split_neurons, I_e = pool / E).
        router_steps: Adam steps per router (router_fit.fit_router).
        router_batch: calibration tokens per Adam step of the router fit (minibatches over all of them).
        ridge: damping of the down-projection refit (refit.refit_down).
        relative_refit: weight the refit by 1 / ||dense output||^2 per token (refit.refit_down).
        seed: seed of every random choice (clustering start, the report's random routing).
    """

    n_experts: int = 16
    top_k: int = 4
    # recipe 5 (chat + prose calibration), measured exact / random-routing perplexity ratios: shared
    # 1024 with 80-neuron clustered experts 1.260x dense / 1.188x; 992 + 80: 1.290x / 1.186x;
    # prose only, 1024 + 64: 1.280x / 1.150x; 960 + 96: 1.301x / 1.178x; 1088 + 80: 1.201x / 1.111x.
    shared_neurons: int = 1024
    expert_neurons: int | None = 80
    router_steps: int = 100
    router_batch: int = 2048  # 1024-4096 measured equal (layer 3 held error 0.0911); 2048 is ~2x faster than 4096
    ridge: float = 1e-3
    relative_refit: bool = True
    seed: int = 0


@dataclass
class LayerReport:
    """What converting one layer achieved on held-back calibration tokens.

    Errors are mean ||dense FFN output - converted output||^2 / ||dense FFN output||^2.

    Attributes:
        layer: layer index.
        recall: router top-K ∩ oracle top-K / K (router_fit.RouterFit.recall).
        rel_err: error of the converted layer (fitted router, refitted down projections).
        random_rel_err: the same layer with K random experts per token.
        shared_only_rel_err: the shared neurons alone with their dense down projection.
        seconds: wall time of this layer's conversion.
    """

    layer: int
    recall: float
    rel_err: float
    random_rel_err: float
    shared_only_rel_err: float
    seconds: float


@dataclass
class ConversionReport:
    """Per-layer reports plus the wall time of the whole conversion in seconds."""

    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0


def moe_config(dense: LlamaForCausalLM, layout: MoeLayout) -> Qwen2MoeConfig:
    """The Qwen2-MoE config equivalent to ``dense`` with ``layout``'s experts.

    RoPE theta, head_dim, GQA heads, norm epsilon and the tied embeddings are set explicitly:
    Qwen2-MoE's defaults differ from SmolLM2's (theta 1e6, qkv_bias=True, untied).
    """
    c = dense.config
    routed = c.intermediate_size - layout.shared_neurons
    if layout.expert_neurons is None:
        if routed <= 0 or routed % layout.n_experts:
            raise ValueError(f"{routed} routed neurons cannot form {layout.n_experts} equal experts")
        width = routed // layout.n_experts
    elif not 0 < layout.expert_neurons <= routed:
        raise ValueError(f"experts of {layout.expert_neurons} neurons cannot come from a pool of {routed}")
    else:
        width = layout.expert_neurons
    if width % 4:
        # transformers' grouped expert matmul (torch._grouped_mm) needs 16-byte strides: a float32
        # expert of 26 neurons fails at inference time, so refuse it here.
        raise ValueError(f"experts of {width} neurons: the width must be a multiple of 4")
    return Qwen2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"]},
        tie_word_embeddings=True, qkv_bias=False, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=width, shared_expert_intermediate_size=layout.shared_neurons,
        num_experts=layout.n_experts, num_experts_per_tok=layout.top_k, norm_topk_prob=True,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        architectures=["Qwen2MoeForCausalLM"], dtype="float32",
    )


def copy_dense_parts(dense: LlamaForCausalLM, moe: Qwen2MoeForCausalLM) -> None:
    """Copy embeddings, final norm, attention and norms (everything but the FFNs)."""
    moe.model.embed_tokens.weight.copy_(dense.model.embed_tokens.weight)
    moe.model.norm.weight.copy_(dense.model.norm.weight)
    for d_layer, m_layer in zip(dense.model.layers, moe.model.layers):
        m_layer.input_layernorm.weight.copy_(d_layer.input_layernorm.weight)
        m_layer.post_attention_layernorm.weight.copy_(d_layer.post_attention_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(m_layer.self_attn, name).weight.copy_(getattr(d_layer.self_attn, name).weight)


@dataclass(frozen=True)
class LayerFits:
    """One layer's fitted choices: which neurons form which expert, and the router.

    They are the slow part of the recipe (clustering, oracle, router fit: about 40% of a layer's
    time) and small (about 40 kB a layer), so the recipe's results ship with moespec
    (fits.py) and a user's build refits only the down projections on them.

    Attributes:
        shared: [n_shared] int64 neuron indices of the shared expert, ascending.
        experts: [E, I_e] int64 neuron indices of the routed experts, rows ascending.
        router: [E, H] float32 router weight, as the checkpoint stores it.
        recall: router top-K vs oracle top-K recall on the fit's held-back tokens (router_fit.RouterFit).
    """

    shared: torch.Tensor
    experts: torch.Tensor
    router: torch.Tensor
    recall: float


def fit_layer(s: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor, layout: MoeLayout) -> LayerFits:
    """The slow part of the recipe for one layer: neuron split, oracle, router fit (float64).

    Args:
        s: [T_fit, H] router inputs of the fit tokens (any float dtype; fitted in WORK_DTYPE).
        act: [T_fit, I] their dense SwiGLU activations.
        w_down: [H, I] the dense down projection.
        layout: the expert layout and fitting settings.

    Returns:
        The :class:`LayerFits`; its router is rounded to float32 (the checkpoint's dtype), and the
        down-projection refit routes with that rounded router, as the checkpoint will.
    """
    s, act, w_down = s.to(WORK_DTYPE), act.to(WORK_DTYPE), w_down.to(WORK_DTYPE)
    if layout.expert_neurons is None:
        split = split_neurons(act, w_down, layout.shared_neurons, layout.n_experts)
    else:
        split = cluster_experts(s, act, w_down, layout.shared_neurons, layout.n_experts,
                                layout.top_k, layout.expert_neurons, seed=layout.seed)
    # What the routed experts should add: the dense output of the pool neurons (the sum of the
    # experts' outputs would count neurons that several experts share more than once).
    pool = torch.ones(w_down.shape[1], dtype=torch.bool).index_fill_(0, split.shared, False)  # [I]
    routed_target = act[:, pool] @ w_down[:, pool].T  # [T_fit, H]
    idx = split.experts  # [E, I_e]
    oracle = oracle_topk_factored(act[:, idx], w_down[:, idx], layout.top_k, routed_target)  # [T_fit, K]
    del routed_target
    fit = fit_router(s, oracle, layout.n_experts, steps=layout.router_steps,
                     batch_tokens=layout.router_batch, seed=layout.seed)
    return LayerFits(shared=split.shared, experts=idx, router=fit.weight.float(), recall=fit.recall)


def _convert_ffn(dense_mlp: torch.nn.Module, block: torch.nn.Module, s: torch.Tensor,
                 layout: MoeLayout, fits: LayerFits | None = None) -> tuple[LayerReport, torch.Tensor, LayerFits]:
    """Fill one Qwen2MoeSparseMoeBlock from one LlamaMLP using router inputs ``s`` [T, H].

    ``dense_mlp`` and ``s`` are in STREAM_DTYPE; the fits and the down-projection refit run in
    WORK_DTYPE (float64); the block's float32 parameters receive the results rounded once. The
    last 10% of the tokens are held back from every fit and give the report's errors.

    Args:
        fits: this layer's recorded :class:`LayerFits` (the refit then only refits the down
            projections on them), or None to fit them here (:func:`fit_layer`).

    Returns:
        The layer's report, the converted layer's output on ``s`` ([T, H], STREAM_DTYPE: shared
        expert + the router's top-K experts with their renormalised weights), and the fits used.
    """
    w_gate = dense_mlp.gate_proj.weight  # [I, H]
    w_up = dense_mlp.up_proj.weight  # [I, H]
    w_down = dense_mlp.down_proj.weight  # [H, I]
    # In place (silu_, mul_): the same values with one [T, I] temporary instead of two.
    act = torch.nn.functional.silu(s @ w_gate.T, inplace=True).mul_(s @ w_up.T)  # [T, I]
    n_fit = s.shape[0] - s.shape[0] // 10
    target = act @ w_down.T  # [T, H] dense FFN output
    if fits is None:
        fits = fit_layer(s[:n_fit], act[:n_fit], w_down, layout)
    idx = fits.experts  # [E, I_e]
    act_shared, act_routed = act[:, fits.shared], act[:, idx]  # [T, n_sh], [T, E, I_e]
    del act

    logits = s.to(WORK_DTYPE) @ fits.router.to(WORK_DTYPE).T  # [T, E]
    weights, ids = topk_weights(logits, layout.top_k)  # [T, K]
    # The refit makes its own WORK_DTYPE copies and scales them in place: the build's peak memory.
    down = refit_down_routed(act_shared[:n_fit], act_routed[:n_fit], ids[:n_fit], weights[:n_fit],
                             target[:n_fit], layout.ridge, layout.relative_refit,
                             dtype=WORK_DTYPE).to(s.dtype)  # [H, I]
    n_sh = layout.shared_neurons
    routed_features = moe_features(act_shared[:, :0], act_routed, ids, weights)  # [T, E * I_e]
    output = act_shared @ down[:, :n_sh].T + routed_features @ down[:, n_sh:].T  # [T, H] (returned, scored on held rows)
    del routed_features
    held = slice(n_fit, None)  # the report's random routing runs on the held-back rows only
    gen = torch.Generator().manual_seed(layout.seed)
    rand_ids = torch.topk(torch.rand(logits[held].shape, generator=gen), layout.top_k, dim=-1).indices  # [T_h, K]
    rand_w = torch.gather(torch.softmax(logits[held], dim=-1), 1, rand_ids)
    rand_features = moe_features(act_shared[held], act_routed[held], rand_ids, rand_w / rand_w.sum(-1, keepdim=True))
    shared_target = act_shared[held] @ w_down[:, fits.shared].T  # [T_h, H] the shared neurons' dense output
    report = LayerReport(layer=-1, recall=fits.recall, seconds=0.0,
                         rel_err=relative_error(target[held], output[held]),
                         random_rel_err=relative_error(target[held], rand_features @ down.T),
                         shared_only_rel_err=relative_error(target[held], shared_target))

    n_experts, i_e = idx.shape
    shared = block.shared_expert
    shared.gate_proj.weight.copy_(w_gate[fits.shared])
    shared.up_proj.weight.copy_(w_up[fits.shared])
    shared.down_proj.weight.copy_(2.0 * down[:, :n_sh])  # shared_expert_gate = 0: sigmoid(0) = 0.5 exactly
    block.shared_expert_gate.weight.zero_()
    block.experts.gate_up_proj.copy_(torch.cat([w_gate[idx], w_up[idx]], dim=1))  # [E, 2 I_e, H]
    block.experts.down_proj.copy_(down[:, n_sh:].reshape(-1, n_experts, i_e).permute(1, 0, 2))  # [E, H, I_e]
    block.gate.weight.copy_(fits.router)  # [E, H]
    return report, output, fits


ATTENTION_WINDOWS = 8  # calibration windows per attention call: bounds SDPA's [n, heads, S, S] scores


def moe_block(config: Qwen2MoeConfig) -> torch.nn.Module:
    """An empty Qwen2-MoE sparse block of ``config`` (float32), filled by :func:`convert_layer`."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    return Qwen2MoeSparseMoeBlock(config).eval()


def calibration_inputs(dense: LlamaForCausalLM, calib_ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Layer 0's input and the rotary embeddings of the calibration windows, in STREAM_DTYPE.

    Args:
        dense: the dense model (float32).
        calib_ids: [N, S] int64 calibration token ids.

    Returns:
        (h [N, S, H] STREAM_DTYPE embeddings, (cos, sin) each [1, S, head_dim] STREAM_DTYPE: every
        window starts at position 0, so one row serves all of them).
    """
    h = dense.model.embed_tokens(calib_ids).to(STREAM_DTYPE)  # [N, S, H]
    position_ids = torch.arange(calib_ids.shape[1])[None]  # [1, S]
    rope = tuple(t.to(STREAM_DTYPE) for t in dense.model.rotary_emb(h, position_ids))
    return h, rope


@torch.no_grad()
def convert_layer(dense_layer: torch.nn.Module, block: torch.nn.Module, h: torch.Tensor, rope: tuple,
                  layout: MoeLayout, fits: LayerFits | None = None) -> tuple[LayerReport, torch.Tensor, LayerFits]:
    """Convert one decoder layer's FFN into ``block`` and advance the calibration states through it.

    Args:
        dense_layer: the dense LlamaDecoderLayer (float32; copied to STREAM_DTYPE here, one layer at
            a time, so no second copy of the whole model exists).
        block: the layer's Qwen2MoeSparseMoeBlock (float32), filled in place.
        h: [N, S, H] STREAM_DTYPE hidden states entering the layer (through the converted layers before it);
            overwritten: the layer's result is written into its memory (one [N, S, H] copy fewer).
        rope: (cos, sin) from :func:`calibration_inputs`.
        layout: the expert layout and fitting settings.
        fits: the layer's recorded fits (fits.py), or None to fit them (the full recipe).

    Returns:
        (the layer's report with ``layer`` = -1 and ``seconds`` = 0 for the caller to fill,
        h after the converted layer: [N, S, H] STREAM_DTYPE, the fits used).
    """
    work = copy.deepcopy(dense_layer).to(STREAM_DTYPE)
    r = h  # [N, S, H]: the residual stream, updated in place window by window
    for start in range(0, h.shape[0], ATTENTION_WINDOWS):
        part = h[start:start + ATTENTION_WINDOWS]  # [n, S, H]
        cos, sin = (t.expand(part.shape[0], -1, -1) for t in rope)
        # attention_mask=None: SDPA applies the causal mask itself for S > 1.
        attn, _ = work.self_attn(work.input_layernorm(part), position_embeddings=(cos, sin), attention_mask=None)
        part.add_(attn)  # each window's attention reads only its own rows, so they can be replaced
    s = work.post_attention_layernorm(r)  # [N, S, H]
    report, out, fits = _convert_ffn(work.mlp, block, s.reshape(-1, s.shape[-1]), layout, fits)
    del s
    return report, r.add_(out.reshape(r.shape)), fits  # [N, S, H]: what the converted block computes


@torch.no_grad()
def convert(dense: LlamaForCausalLM, calib_ids: torch.Tensor, layout: MoeLayout,
            on_layer: Callable[[LayerReport], None] | None = None) -> tuple[Qwen2MoeForCausalLM, ConversionReport]:
    """Build the Qwen2-MoE model from ``dense`` (float32, CPU), fitting routers on ``calib_ids``.

    Every fit (neuron split, oracle, router, down-projection refit) runs in float64
    (WORK_DTYPE); the calibration forward (attention, activations, targets, the converted layer's
    output) runs in float32 (STREAM_DTYPE) on one layer's copy at a time; the written weights are
    float32. Why float64 fits: float32 fits differed between runs in the last bits, and the router
    fit's Adam steps and near-tied logits turned such bits into different expert choices (held-out
    perplexity 31.1 vs 31.6 for one recipe); in float64 two runs agree to ~1e-12. Why a float32
    forward: it is the forward the checkpoint itself runs, and it halves the time and memory of the
    largest products; its last-bit differences between machines reach the fits only through a
    well-damped ridge solve, so the weights move by about float32 rounding (recipe 6 measured both).
    The default-model build runs the same :func:`convert_layer` steps with a checkpoint after each.

    Args:
        dense: the dense model, float32, eval mode.
        calib_ids: [N, S] int64 calibration token ids.
        layout: the expert layout and fitting settings.
        on_layer: called with each layer's report as soon as the layer is done (progress).

    Returns:
        The converted model (float32, eval mode) and the conversion report.
    """
    start = time.perf_counter()
    torch.manual_seed(layout.seed)
    moe = Qwen2MoeForCausalLM(moe_config(dense, layout)).eval()
    copy_dense_parts(dense, moe)
    report = ConversionReport()
    h, rope = calibration_inputs(dense, calib_ids)  # [N, S, H]
    for index, (d_layer, m_layer) in enumerate(zip(dense.model.layers, moe.model.layers)):
        t0 = time.perf_counter()
        layer_report, h, _ = convert_layer(d_layer, m_layer.mlp, h, rope, layout)
        layer_report.layer, layer_report.seconds = index, time.perf_counter() - t0
        report.layers.append(layer_report)
        if on_layer is not None:
            on_layer(layer_report)
    moe.tie_weights()
    report.seconds = time.perf_counter() - start
    return moe, report
