"""The compiled dense path: decode steps' dense segments through torch.compile, MoE dispatch eager.

Shapes: H hidden, V vocabulary, Hk key-value heads, D head dim, L cached positions.

A decode step (one token) runs, per decoder layer, the input norm, the attention with its KV cache
update and the residual add as ONE compiled graph; the router-input norm (it records r_l for the
predictors) and the MoE block (router, host read, expert cache, shared expert: the layer runner,
runtime/layer) stay eager, the one graph break per layer the host dispatch needs. The final norm
and lm_head are two more compiled graphs. Prefills (more than one token) run eager: their length
changes every call, and one prefill per turn does not pay for a compile per length.

One graph for every layer: a lean decoder layer (runtime/decode_layer.py: Qwen2-MoE, Qwen3-MoE,
Mixtral) runs ``decode_layer.lean_attention``, one function that takes the layer's modules and its
KV tensors [1, Hk, L, D] as arguments (dynamo lifts the modules' weights to graph inputs and guards
on shapes and values the layers share), with L marked dynamic from the first call. A start so
traces three graphs (attention, final norm, lm_head) whatever the layer count; tracing each layer's
segment on its own, at its first length and again when the length changed, traced 2 x 30 + 3 on
the default model (README "Decode at the memory floor": +92 s on the first start, +55 s on later
ones, now +19 s and +3 s). Other layers (OLMoE, GPT-OSS, DeepSeek) keep a compiled segment per
layer, their KV length marked dynamic too.

Inductor on CPU (C++ kernels; needs a C++ compiler), CUDA graphs on CUDA are not used yet (the
graphs are split by the host dispatch). Compiled artefacts go to inductor's caches (FX graph and
AOT caches, on disk under ``TORCHINDUCTOR_CACHE_DIR``), so a second start skips code generation
and C++ builds and pays only dynamo's tracing of the three graphs.

Eager is the reference: ``--compile off`` runs the same model instance uncompiled, and the tests
compare logits (within 1e-5 in float32) and greedy tokens over a multi-turn conversation.

Where compiling fails (no C++ compiler, an op inductor refuses), the first compiled call falls back
to eager for good and leaves a one-line note; it never raises (``CompiledDense.failure``).
"""

from __future__ import annotations

import functools
import shutil

import torch
from torch import nn

from moespec.runtime.decode_layer import lean_attention
from moespec.runtime.model import OffloadedMoeBlock, OffloadedModel

# Why: the decoder layers share one code object (their forward); dynamo keys guards on it, so the
# default limit of 8 entries would send every later layer back to eager.
_RECOMPILE_LIMIT = 256


def compiler_missing(device: torch.device) -> str | None:
    """Why inductor cannot compile here, in one line, or None. CPU needs a C++ compiler on PATH."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++) on PATH: decoding eager (install g++ or pass --compile off)"
    return None


class CompiledDense:
    """The compiled decode segments of one OffloadedModel; ``install`` wraps the model's modules.

    Attributes:
        failure: one-line note when compiling failed (the model then runs eager), else None.
        calls: compiled segment calls so far (tests check the compiled path actually ran).
    """

    def __init__(self, om: OffloadedModel) -> None:
        self.om = om
        self.failure: str | None = None
        self.calls = 0
        self._undo: list[tuple[nn.Module, str, object]] = []
        self._lean_segments: dict[object, object] = {}  # LeanShape -> its compiled lean_attention

    def install(self) -> None:
        """Wrap every decoder layer, the final norm and lm_head for decode steps; disable tracing of
        the MoE blocks. Idempotent per instance (``uninstall`` restores the originals)."""
        import torch._dynamo.config as dynamo_config

        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, _RECOMPILE_LIMIT)
        if hasattr(dynamo_config, "recompile_limit"):
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
        if hasattr(dynamo_config, "accumulated_recompile_limit"):
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
        model = self.om.model
        steps = self.om.decode.steps if self.om.decode is not None else {}
        for layer in model.model.layers:
            if layer in steps:  # the lean step's attention: one compiled graph for every layer
                self._wrap_lean_layer(layer, steps[layer])
            elif isinstance(layer.mlp, OffloadedMoeBlock):
                self._wrap_moe_layer(layer)
            else:  # a dense layer (DeepSeek's first layers): compiled whole
                self._wrap(layer, layer.forward)
        self._wrap(model.model.norm, model.model.norm.forward)
        self._wrap(model.lm_head, model.lm_head.forward)

    def uninstall(self) -> None:
        """Restore the eager modules (the reference path on the same instance)."""
        for module, name, before in reversed(self._undo):
            if before is None:
                delattr(module, name)
            else:
                setattr(module, name, before)
        self._undo.clear()

    def _set(self, module: nn.Module, name: str, value) -> None:
        self._undo.append((module, name, module.__dict__.get(name)))
        setattr(module, name, value)

    def _wrap_lean_layer(self, layer: nn.Module, step) -> None:
        """A lean decode layer (runtime/decode_layer.py) as: compiled ``lean_attention`` (input norm,
        attention with its KV append, residual add), eager router-input norm (it records r_l for
        the predictors) and MoE block. ``lean_attention`` takes the layer's modules and tensors as
        arguments, so every layer of one shape runs the same graph: one trace per start, not one
        per layer (dynamo lifts the modules' weights to graph inputs)."""
        segment = self._lean_segments.get(step.shape)
        if segment is None:
            segment = self._lean_segments[step.shape] = self._compiled(lean_attention)
        eager, rope = layer.forward, self.om.decode.rope

        def decode_step(hidden_states, *args, **kwargs):
            found = step.store_for(hidden_states, args, kwargs)
            if found is None:  # not a lean step (a hook, a mask, another cache class): eager
                return eager(hidden_states, *args, **kwargs)
            store, position_embeddings = found
            cos, sin = rope(*position_embeddings)
            keys, values = _dynamic_length(store.keys), _dynamic_length(store.values)
            h, store.keys, store.values = segment(step.shape, step.modules, hidden_states, keys, values,
                                                  cos, sin)
            out = step.mlp.forward(step.post_norm.forward(h))  # the host dispatch: the graph break
            return h + (out[0] if isinstance(out, tuple) else out)

        self._wrap(layer, eager, decode_step)

    def _wrap_moe_layer(self, layer: nn.Module) -> None:
        """The MoE decoder layer's decode step as: compiled segment (input norm, attention with its
        KV cache update, residual add, router-input norm), eager MoE block, eager residual add; the
        same operations in the same order as the layer's own forward (every family's is alike)."""

        def dense_part(hidden_states, **kwargs):
            residual = hidden_states
            x, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
            h = residual + x  # [1, 1, H]
            return h, layer.post_attention_layernorm(h)

        segment = self._compiled(_own_code(dense_part, len(self._undo)))
        idx = layer.self_attn.layer_idx

        def decode_step(hidden_states, **kwargs):
            _dynamic_cache(kwargs.get("past_key_values"), idx)
            h, s = segment(hidden_states, **kwargs)
            out = layer.mlp(s)  # the host dispatch: the one graph break
            return h + (out[0] if isinstance(out, tuple) else out)  # GPT-OSS: (output, None)

        self._wrap(layer, layer.forward, decode_step)

    def _compiled(self, fn):
        """``fn`` through inductor; on a compiler failure one note, then ``fn`` eager for good."""
        compiled = torch.compile(fn, backend="inductor", dynamic=None)

        def run(*args, **kwargs):
            if self.failure is None:
                try:
                    out = compiled(*args, **kwargs)
                except KeyboardInterrupt:
                    raise
                except Exception as err:  # noqa: BLE001  (any compiler failure: one note, then eager)
                    self.failure = _one_line(err)
                    self.om.notes.append(f"compile failed ({self.failure}): decoding eager")
                else:
                    self.calls += 1
                    return out
            return fn(*args, **kwargs)

        return run

    def _wrap(self, module: nn.Module, eager, decode=None) -> None:
        """``module.forward``: ``decode`` (default: ``eager`` compiled) for one token, else ``eager``."""
        decode = decode or self._compiled(_own_code(eager, len(self._undo)))

        @functools.wraps(eager)
        def forward(hidden_states, *args, **kwargs):
            if hidden_states.shape[-2] != 1 or self.failure is not None:
                return eager(hidden_states, *args, **kwargs)
            return decode(_packed(hidden_states), *args, **kwargs)

        self._set(module, "forward", forward)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides, copied only when its strides differ. Why: a prefill's last row
    ([1, 1, H] of [1, T, H], strides (T * H, H, 1)) is "contiguous" to torch but fails dynamo's
    stride guard of a decode step's (H, H, 1): a second graph for the final norm."""
    stride, n = [], 1
    for size in reversed(x.shape):
        stride.append(n)
        n *= size
    return x if tuple(reversed(stride)) == x.stride() else x.clone(memory_format=torch.contiguous_format)


def _dynamic_length(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` [1, Hk, L, D] with L marked dynamic. Why: dynamo compiles the first call for its
    static L and compiles again at L + 1 (automatic dynamic); marked from the first call, one graph
    serves every length (L = 1 still specialises: dynamo never generalises a size of 1)."""
    if kv.dim() == 4:
        torch._dynamo.maybe_mark_dynamic(kv, 2)
    return kv


def _dynamic_cache(cache, idx: int) -> None:
    """Mark the KV length of layer ``idx`` of a transformers cache dynamic (:func:`_dynamic_length`)."""
    layers = getattr(cache, "layers", None)
    if layers is None or idx is None or idx >= len(layers):
        return
    for name in ("keys", "values"):
        kv = getattr(layers[idx], name, None)
        if isinstance(kv, torch.Tensor):
            _dynamic_length(kv)


def _own_code(fn, tag: int):
    """``fn`` behind a function with its own code object. Why: dynamo keeps its compiled entries
    per code object and checks them in turn; the decoder layers share one forward, so 30 layers
    would walk up to 60 guard sets per call. One code object per module keeps it to one or two."""

    def segment(*args, **kwargs):
        return fn(*args, **kwargs)

    segment.__code__ = segment.__code__.replace(co_name=f"segment_{tag}", co_firstlineno=1000 + tag)
    return segment


def _one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:120]


def resolve_compile(mode: str, device: torch.device) -> bool:
    """``--compile`` auto|on|off -> compile or not. auto: on for CUDA (launch overhead per op is
    what the graphs remove); off on CPU, where the compiled path decoded the default model slower
    than eager (44.7 against 35.6 ms TPOT, scripts/decode_floor.py, README) and a start pays
    +19 s on a fresh inductor cache, +3 s on a warm one (scripts/compile_start.py)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def apply_compile(om: OffloadedModel, mode: str) -> CompiledDense | None:
    """``compile_dense(om)`` when ``mode`` (``--compile``) resolves to on for om's device, else None."""
    return compile_dense(om) if resolve_compile(mode, om.device) else None


def compile_dense(om: OffloadedModel) -> CompiledDense | None:
    """Install the compiled decode path on ``om`` (module docstring); returns it, or None with a
    one-line note in ``om.notes`` when this machine cannot compile (no C++ compiler)."""
    missing = compiler_missing(om.device)
    if missing is not None:
        om.notes.append(missing)
        return None
    dense = CompiledDense(om)
    dense.install()
    return dense
