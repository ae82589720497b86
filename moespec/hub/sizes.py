"""How big a Mixture-of-Experts checkpoint is, split into experts and the dense rest, from config.json alone.

Counts parameters per family (one small function each, registered in ``_FAMILIES``), then turns
them into bytes with the checkpoint's dtype. The number that bounds offloaded decoding is the
zero-cache H2D bytes per decode token: with no expert cached, every MoE layer copies its K routed
experts, so ``num_moe_layers × K × expert_bytes`` cross the link for each generated token.

Families that differ:
  - gpt_oss: experts carry biases (gate_up bias 2I, down bias H) and ship as MXFP4 blocks + scales
    (4.25 bits per weight, biases in the checkpoint dtype), so the bytes of one expert follow the
    quantization_config, not the dtype (``expert_dtype`` asks for the dequantised size instead);
    int8/int4 (``--expert-dtype``) are refused for it, as the runtime refuses them;
    attention has biases and one sink per head.
  - deepseek_v2/v3, glm4_moe_lite: MLA attention; the first layers are dense MLPs
    (first_k_dense_replace, or mlp_layer_types); n_shared_experts × moe_intermediate_size shared
    (dense) width; the router's e_score_correction_bias is a buffer and not counted; an MTP layer
    beyond num_hidden_layers (V3) is not counted: transformers does not build it.
With ``expert_dtype`` int8 / int4 (or w8a8 / w4a8, the same rows) every other family's experts count
as moespec quantises them at load (moespec.models.quant_layout): codes (1 or 1/2 byte per weight) +
a float16 scale and a uint8 zero point per group of ``group_size`` columns of each weight row
(gate/up rows of H columns, down rows of I), the row padded to 16 bytes.
Each family has a ``_count_<family>`` returning :class:`ParamCounts`, a test against the transformers
model built from a tiny config (tests/test_hub_sizes.py), and an entry in ``_FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from moespec.errors import OptionError, UnsupportedModelError
from moespec.units import format_bytes, format_bytes_short  # noqa: F401  (their home before moespec.units)

# Host RAM the runtime keeps free beyond the weights (Python, torch, tokenizer, I/O buffers); the load
# refuses to start below experts (+ dense on CPU) + this (moespec.runtime.host.memory).
HOST_HEADROOM_BYTES = 512 * 2**20

QUANT_BITS = {"int8": 8, "int4": 4, "w8a8": 8, "w4a8": 4}  # --expert-dtype values quantised at load
QUANT_GROUPS = (32, 64, 128, 256)  # = moespec.kernels.lowbit.SUPPORTED_GROUPS (a test checks)
QUANT_GROUP_BYTES = 3  # float16 scale + uint8 zero point per group (moespec.models.quant)
DEFAULT_GROUP_SIZE = 64  # = moespec.models.quant.DEFAULT_GROUP_SIZE (this module never imports torch)
ROW_ALIGN = 16  # packed rows are padded to 16 bytes
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one checkpoint (numbers of scalars, not bytes).

    Attributes:
        expert_params: parameters of ONE routed expert (gate, up, down and biases if any).
        num_moe_layers: layers with routed experts.
        num_experts: E, routed experts per MoE layer.
        top_k: K, experts a token is routed to.
        dense_params: everything else: embeddings, attention, norms, routers, shared experts,
            dense MLP layers and lm_head.
        expert_bias_params: the part of expert_params that are biases (never quantised).
    """

    expert_params: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    dense_params: int
    expert_bias_params: int = 0

    @property
    def total_expert_params(self) -> int:
        return self.expert_params * self.num_experts * self.num_moe_layers

    @property
    def total_params(self) -> int:
        return self.total_expert_params + self.dense_params


@dataclass(frozen=True)
class ModelSizes:
    """Byte sizes of a checkpoint, derived from :class:`ParamCounts` and the dtype.

    Attributes:
        model_type: config.json's model_type.
        dtype: the weights' dtype name (e.g. "bfloat16").
        bytes_per_param: 2 for bf16/fp16, 4 for fp32.
        params: the parameter counts.
        expert_format: "mxfp4" when experts are kept packed (GPT-OSS checkpoints), "int8" / "int4" when
            quantised at load, else the dtype.
        group_size: columns per scale of int8/int4 experts (0 otherwise).
        hidden: H (config hidden_size), for the groups per row of a quantised expert (0: unknown).
    """

    model_type: str
    dtype: str
    bytes_per_param: int
    params: ParamCounts
    expert_format: str = ""
    group_size: int = 0
    hidden: int = 0

    @property
    def expert_bytes(self) -> int:
        """Bytes of ONE routed expert: the unit one host-to-device copy moves (stored = moved)."""
        if self.expert_format == "mxfp4":  # 4 bits per weight + one 8-bit scale per 32; biases unquantised
            weights = self.params.expert_params - self.params.expert_bias_params
            return weights // 2 + weights // 32 + self.params.expert_bias_params * self.bytes_per_param
        if self.expert_format in QUANT_BITS:  # codes + (scale, zero) per group, row padded to 16 bytes
            weights = self.params.expert_params
            used = weights * QUANT_BITS[self.expert_format] // 8 + self._groups(weights) * QUANT_GROUP_BYTES
            return used + (-used) % ROW_ALIGN
        return self.params.expert_params * self.bytes_per_param

    def _groups(self, weights: int) -> int:
        """Groups of one SwiGLU expert: gate_up 2I rows of ceil(H/g), down H rows of ceil(I/g)."""
        g, h = self.group_size, self.hidden
        i = weights // (3 * h) if h else 0
        if not i or 3 * h * i != weights:
            return weights // g
        return 2 * i * -(-h // g) + h * -(-i // g)

    @property
    def experts_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers (what lives in host memory)."""
        return self.expert_bytes * self.params.num_experts * self.params.num_moe_layers

    @property
    def dense_bytes(self) -> int:
        """Bytes of everything that stays on the device (attention, embeddings, shared experts...)."""
        return self.params.dense_params * self.bytes_per_param

    @property
    def total_bytes(self) -> int:
        return self.experts_bytes + self.dense_bytes

    @property
    def host_ram_bytes(self) -> int:
        """Host RAM a run with a GPU needs: all experts in the (pinned, exact-size) store + headroom.

        The dense part goes to the GPU; the checkpoint itself is read through the page cache.
        """
        return self.experts_bytes + HOST_HEADROOM_BYTES

    @property
    def host_ram_cpu_bytes(self) -> int:
        """Host RAM a CPU-only run needs: the experts and the dense part (both stay on the host) + headroom."""
        return self.experts_bytes + self.dense_bytes + HOST_HEADROOM_BYTES

    @property
    def from_disk_min_ram_bytes(self) -> int:
        """Host RAM a CPU run with the experts on disk needs at least: :func:`from_disk_min_ram`."""
        return from_disk_min_ram(self.dense_bytes, self.params.top_k, self.expert_bytes)

    def runs_from_disk(self, available_ram: int) -> bool:
        """True when a CPU run keeps the experts on disk on a host with ``available_ram`` bytes free."""
        return self.host_ram_cpu_bytes > available_ram

    @property
    def zero_cache_h2d_bytes_per_token(self) -> int:
        """num_moe_layers × top_k × expert_bytes: bytes copied per decode token with no expert cached."""
        return self.params.num_moe_layers * self.params.top_k * self.expert_bytes


def _get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is not None:
        return default
    raise UnsupportedModelError(
        f"config.json has none of {', '.join(names)}", "the checkpoint's config.json is incomplete; re-download it"
    )


def _attention_params(c: Mapping[str, Any], qkv_bias: bool, qk_norm: str) -> int:
    """q/k/v/o projections (+ q/k biases, + q/k norms) of one layer.

    qk_norm: "" none, "head" RMSNorm over head_dim (Qwen3), "full" over the projection width (OLMoE).
    """
    h = c["hidden_size"]
    n_heads = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads") or n_heads
    head_dim = c.get("head_dim") or h // n_heads
    q, kv = n_heads * head_dim, n_kv * head_dim
    params = h * q + 2 * h * kv + q * h
    if qkv_bias or c.get("attention_bias"):
        params += q + 2 * kv + (h if c.get("attention_bias") else 0)
    if qk_norm == "head":
        params += 2 * head_dim
    elif qk_norm == "full":
        params += q + kv
    return params


def _embeddings_params(c: Mapping[str, Any]) -> int:
    """Input embeddings, the final norm and lm_head (unless tied)."""
    vocab, h = c["vocab_size"], c["hidden_size"]
    return vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h


def _moe_layer_ids(c: Mapping[str, Any]) -> list[int]:
    """Qwen-style sparse placement: layer i is MoE unless in mlp_only_layers, every decoder_sparse_step."""
    step = c.get("decoder_sparse_step") or 1
    mlp_only = set(c.get("mlp_only_layers") or [])
    return [i for i in range(c["num_hidden_layers"]) if i not in mlp_only and (i + 1) % step == 0]


def _count_qwen(c: Mapping[str, Any], shared: bool, qkv_bias: bool, qk_norm: str) -> ParamCounts:
    h, n_layers = c["hidden_size"], c["num_hidden_layers"]
    e = _get(c, "num_experts", "num_local_experts")
    i_exp = _get(c, "moe_intermediate_size")
    moe_ids = _moe_layer_ids(c)
    per_layer_common = _attention_params(c, qkv_bias, qk_norm) + 2 * h  # + input/post-attention norms
    dense = _embeddings_params(c) + n_layers * per_layer_common
    dense += len(moe_ids) * e * h  # routers H -> E
    dense += (n_layers - len(moe_ids)) * 3 * h * _get(c, "intermediate_size")  # dense MLP layers
    if shared:  # differs from Qwen3: a shared expert (SwiGLU, width S) + its sigmoid gate H -> 1, dense
        dense += len(moe_ids) * (3 * h * _get(c, "shared_expert_intermediate_size") + h)
    return ParamCounts(3 * h * i_exp, len(moe_ids), e, _get(c, "num_experts_per_tok"), dense)


def _count_qwen3_moe(c: Mapping[str, Any]) -> ParamCounts:
    return _count_qwen(c, shared=False, qkv_bias=False, qk_norm="head")


def _count_qwen2_moe(c: Mapping[str, Any]) -> ParamCounts:
    return _count_qwen(c, shared=True, qkv_bias=bool(c.get("qkv_bias", True)), qk_norm="")


def _count_every_layer_moe(c: Mapping[str, Any], qk_norm: str) -> ParamCounts:
    """Mixtral and OLMoE: every layer is MoE, experts have width intermediate_size, no shared expert."""
    h, n_layers = c["hidden_size"], c["num_hidden_layers"]
    e = _get(c, "num_local_experts", "num_experts")
    per_layer = _attention_params(c, False, qk_norm) + 2 * h + e * h  # attention, norms, router
    dense = _embeddings_params(c) + n_layers * per_layer
    return ParamCounts(3 * h * _get(c, "intermediate_size"), n_layers, e, _get(c, "num_experts_per_tok"), dense)


def _count_gpt_oss(c: Mapping[str, Any]) -> ParamCounts:
    """Differs: biased attention with sinks, a biased router, experts with biases (width intermediate_size)."""
    h, i, n_layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    e = _get(c, "num_local_experts", "num_experts")
    attention = _attention_params({**c, "attention_bias": c.get("attention_bias", True)}, False, "")
    per_layer = attention + c["num_attention_heads"] + 2 * h + e * h + e  # + sinks, norms, router weight + bias
    bias = 2 * i + h
    return ParamCounts(3 * h * i + bias, n_layers, e, _get(c, "num_experts_per_tok", "experts_per_token"),
                       _embeddings_params(c) + n_layers * per_layer, expert_bias_params=bias)


def _mla_params(c: Mapping[str, Any]) -> int:
    """DeepSeek multi-head latent attention of one layer (q low-rank when q_lora_rank is set)."""
    h, heads, bias = c["hidden_size"], c["num_attention_heads"], 1 if c.get("attention_bias") else 0
    nope, rope, v, kv_rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    q_rank = c.get("q_lora_rank")
    q = h * heads * (nope + rope) if not q_rank else (h + bias) * q_rank + q_rank + q_rank * heads * (nope + rope)
    kv = (h + bias) * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
    return q + kv + heads * v * h + bias * h


def _count_deepseek(c: Mapping[str, Any]) -> ParamCounts:
    """DeepSeek-V2/V3 and GLM-4.7-Flash: MLA, leading dense layers, shared experts."""
    h, n_layers = c["hidden_size"], c["num_hidden_layers"]
    e, i_exp = _get(c, "n_routed_experts"), _get(c, "moe_intermediate_size")
    kinds = c.get("mlp_layer_types") or (
        ["dense"] * min(c.get("first_k_dense_replace") or 0, n_layers)
        + ["sparse"] * max(n_layers - (c.get("first_k_dense_replace") or 0), 0))
    n_moe = kinds.count("sparse")
    dense = _embeddings_params(c) + n_layers * (_mla_params(c) + 2 * h)
    dense += (n_layers - n_moe) * 3 * h * _get(c, "intermediate_size")  # dense MLP layers
    dense += n_moe * (e * h + 3 * h * i_exp * (c.get("n_shared_experts") or 0))  # router + shared experts
    return ParamCounts(3 * h * i_exp, n_moe, e, _get(c, "num_experts_per_tok"), dense)


_FAMILIES: dict[str, Callable[[Mapping[str, Any]], ParamCounts]] = {
    "qwen3_moe": _count_qwen3_moe,
    "qwen2_moe": _count_qwen2_moe,
    "mixtral": lambda c: _count_every_layer_moe(c, qk_norm=""),
    "olmoe": lambda c: _count_every_layer_moe(c, qk_norm="full"),
    "gpt_oss": _count_gpt_oss,
    "deepseek_v2": _count_deepseek,
    "deepseek_v3": _count_deepseek,
    "glm4_moe_lite": _count_deepseek,
}


def sized_model_types() -> list[str]:
    """model_types whose sizes this module can compute."""
    return sorted(_FAMILIES)


def model_sizes(config: Mapping[str, Any], expert_dtype: str = "auto", group_size: int | None = None) -> ModelSizes:
    """Compute the byte sizes of a checkpoint from its parsed config.json.

    The dtype is config's ``dtype`` (transformers 5) or ``torch_dtype``; bfloat16 when absent.
    A VLM-style config with the text model under ``text_config`` is read from there. Experts of an
    MXFP4 checkpoint (quantization_config.quant_method) count packed, as moespec stores and moves
    them, unless ``expert_dtype`` is not "auto" (``--expert-dtype``: dequantised at load to the dtype).
    ``expert_dtype`` int8 / int4 counts experts quantised with ``group_size`` (default 64) weights per scale.

    Raises:
        UnsupportedModelError: the model_type has no size rule yet, or a needed field is missing.
        OptionError: int8/int4 for gpt_oss (its experts stay MXFP4).
    """
    model_type = str(config.get("model_type") or "")
    if model_type not in _FAMILIES and isinstance(config.get("text_config"), Mapping):
        outer = {k: config[k] for k in ("dtype", "torch_dtype", "quantization_config") if k in config}
        return model_sizes({**config["text_config"], **outer}, expert_dtype, group_size)
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"no size rule for model_type {model_type!r}; known: {', '.join(sized_model_types())}",
            "add a _count_<family> function to moespec/hub/sizes.py",
        )
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    try:
        params = _FAMILIES[model_type](config)
    except KeyError as exc:
        raise UnsupportedModelError(
            f"config.json of this {model_type} model lacks {exc.args[0]!r}", "re-download the model's config.json"
        ) from exc
    quant = config.get("quantization_config") or {}
    bpp = _DTYPE_BYTES.get(dtype, 2)
    if expert_dtype in QUANT_BITS:
        if model_type == "gpt_oss":
            raise OptionError(f"--expert-dtype {expert_dtype} is not supported for gpt_oss experts",
                              "use --expert-dtype auto: GPT-OSS experts stay MXFP4 (4.25 bits) and move packed")
        return ModelSizes(model_type, dtype, bpp, params, expert_dtype, _group(group_size), int(config["hidden_size"]))
    mxfp4 = expert_dtype == "auto" and isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"
    return ModelSizes(model_type, dtype, bpp, params, "mxfp4" if mxfp4 else dtype, hidden=int(config["hidden_size"]))


def _group(group_size: int | None) -> int:
    """The group size asked for (default 64).

    Raises:
        OptionError: a size the low-bit kernels cannot take (names the ones they can).
    """
    group = group_size or DEFAULT_GROUP_SIZE
    if group not in QUANT_GROUPS:
        raise OptionError(f"--group-size {group} is not supported: the low-bit kernels take "
                          f"{', '.join(map(str, QUANT_GROUPS[:-1]))} or {QUANT_GROUPS[-1]}",
                          f"use --group-size {DEFAULT_GROUP_SIZE}")
    return group


def with_expert_dtype(sizes: ModelSizes, expert_dtype: str, group_size: int | None = None) -> ModelSizes:
    """``sizes`` with experts counted as ``--expert-dtype`` int8 / int4 stores them (other values: unchanged).

    GPT-OSS keeps its MXFP4 experts (the runtime refuses int8/int4 for it), so its sizes stay as they are.

    Raises:
        OptionError: a group size the low-bit kernels cannot take.
    """
    if expert_dtype not in QUANT_BITS or sizes.model_type == "gpt_oss" or not isinstance(sizes, ModelSizes):
        return sizes
    return replace(sizes, expert_format=expert_dtype, group_size=_group(group_size))


def from_disk_min_ram(dense_bytes: int, top_k: int, expert_bytes: int) -> int:
    """Host RAM (bytes) a CPU run with the experts on disk needs at least (runtime/disk_tier.py): the
    dense part, 2K expert rows of the RAM tier (each rounded up to 4 KiB, O_DIRECT's alignment) and
    the headroom. Its disk: all the experts' bytes (the store file)."""
    row = -(-expert_bytes // 4096) * 4096
    return dense_bytes + 2 * top_k * row + HOST_HEADROOM_BYTES
