"""The dense linears of a decode step through the native GEMV, and low-bit dense weights (``--dense-dtype``).

Shapes: T tokens, R rows (output features), C columns (input features), H hidden, V vocabulary.

Every ``nn.Linear`` of one model instance outside the experts (attention projections, dense MLPs,
shared experts, lm_head) gets a forward of its own (:func:`install_dense`; this instance only, the
class is untouched). For x [..., C] with T = x.numel() / C:
  - T <= the kernels' token limit (``moespec.kernels.linear.max_tokens``: 8 for float32 weights, 16
    for bf16 / int8) on the CPU: ``moespec.kernels.linear.linear``, the native GEMV, which reads the
    weight once at near memory speed (F.linear at t = 1 reads float32 at about half of it here:
    README "Dense path"). float32: exact (float32 accumulation, another order of the sum, ~1e-7).
  - more tokens (prefill chunks), other devices: F.linear, on the same weight values (bf16 converted,
    int8 dequantised per call), so prefill and decode compute one model.
  - a float weight under :data:`MIN_NATIVE_BYTES` (the ctypes call costs more than it saves on weights
    that stay in cache) is left as it is: its module's own forward, its own dtype.
The router gates are not nn.Linear (transformers' router modules) and stay as they are: at E x H
(16 x 576 here) they are a few KB.

Weight formats (``--dense-dtype``, weight-only; activations and outputs stay in the compute dtype):
  - auto / the compute dtype: the checkpoint's weights, as loaded;
  - bf16 (with float32 compute): the weights rounded to bfloat16 once at load, half the bytes read;
  - int8: group-wise affine int8 (groups of :data:`GROUP_SIZE` columns, moespec.models.quant, the
    experts' format), ~0.28x the float32 bytes; a weight whose C is not a multiple of 16 stays float.
``exact`` then means exact for the quantised model: the reference (:class:`DensePath` with
``reference=True``) runs F.linear on the dequantised weights. A tied embedding keeps its float table
for the lookup (it reads one row per token); lm_head gets its own low-bit copy (it reads all of it).

Under torch.compile (runtime/compile.py) the native call is the custom op ``moespec::dense_gemv``
(``moespec::dense_gemv_q`` for int8), so dynamo records one opaque node instead of tracing ctypes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from moespec.errors import OptionError
from moespec.kernels import linear as kl
from moespec.kernels import native as native_kernels
from moespec.kernels import spin
from moespec.kernels.lowbit import COL_MULTIPLE, LowBitWeight, dequantize
from moespec.runtime import dense_call
from moespec.runtime.forwards import restore_forwards
from moespec.runtime.host import hugepages

DENSE_DTYPES = ("auto", "float32", "bf16", "bfloat16", "int8")
GROUP_SIZE = 64  # as the experts' default (models/quant.DEFAULT_GROUP_SIZE)
# Below this a weight stays on F.linear. Measured (README "Dense path", one thread): at 64 x 64 the
# ctypes path took ~2x F.linear's time; from 192 x 576 float32 (442 KB) on it is as fast or faster.
MIN_NATIVE_BYTES = 256 * 1024
_NAMES = {"float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def check_dense_dtype(name: str) -> None:
    """Refuse a ``--dense-dtype`` that is not one of :data:`DENSE_DTYPES`.

    Raises:
        OptionError: names the value and the choices.
    """
    if name not in DENSE_DTYPES:
        raise OptionError(f"--dense-dtype {name!r} is not valid", "choose one of: auto, float32, bf16, int8")


def resolve_dense_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype | str | None:
    """``--dense-dtype`` -> None (keep the weights), a float dtype to store them in, or "int8".

    Raises:
        OptionError: a float dtype other than the compute dtype's or bf16 under float32 compute; a
            low-bit format off the CPU (the native kernels are CPU kernels).
    """
    check_dense_dtype(name)
    if name == "auto" or _NAMES.get(name) == compute:
        return None
    if device.type != "cpu":
        raise OptionError(f"--dense-dtype {name} runs on the CPU kernels, not on {device.type}",
                          "use --dense-dtype auto (on CUDA: --dtype bfloat16)")
    if name == "int8":
        return "int8"
    if compute != torch.float32:
        raise OptionError(f"--dense-dtype {name} is wider than the compute dtype "
                          f"{str(compute).removeprefix('torch.')}", "use --dense-dtype auto or int8")
    return _NAMES[name]


def stored_weight(weight: torch.Tensor, fmt: torch.dtype | str | None) -> torch.Tensor | LowBitWeight:
    """``weight`` [R, C] as ``fmt`` stores it (:func:`resolve_dense_dtype`); a copy unless fmt is None."""
    if fmt is None:
        return weight.detach()
    if fmt == "int8":
        if weight.shape[1] % COL_MULTIPLE:
            return weight.detach()  # the kernels need C % 16 == 0: this one stays float
        from moespec.models.quant import QuantSpec, quantize

        spec = QuantSpec(8, GROUP_SIZE)
        return quantize(weight, spec).weight(spec, weight.shape[0], weight.shape[1])
    return weight.detach().to(fmt).contiguous()


def as_dense(w: torch.Tensor | LowBitWeight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a [R, C] tensor in ``dtype`` (low-bit: dequantised): what F.linear multiplies."""
    return dequantize(w, dtype) if isinstance(w, LowBitWeight) else w.to(dtype)


@dataclass
class DensePath:
    """The dense linears of one model instance and how they compute (module docstring).

    Attributes:
        weights: module -> its stored weight (float tensor or LowBitWeight), for every wrapped Linear.
        native: the names of the wrapped modules.
        reference: True runs every wrapped Linear as F.linear on its stored weight's values (the
            slow reference the tests compare against); set it at any time.
        calls: native GEMV calls so far (tests check the fast path ran).
        fused: fused units installed (runtime/dense_call.py: q/k/v groups and SiLU MLPs).
    """

    weights: dict[nn.Module, object] = field(default_factory=dict)
    native: set[str] = field(default_factory=set)
    reference: bool = False
    calls: int = 0
    fused: int = 0
    _undo: list[tuple[nn.Module, object]] = field(default_factory=list)
    _freed: list[tuple[nn.Module, torch.dtype]] = field(default_factory=list)

    def bytes_read(self, module: nn.Module) -> int:
        """Bytes one product of ``module``'s stored weight reads (bias left out: a few KB)."""
        return kl.nbytes(self.weights[module])

    def uninstall(self) -> None:
        """Put the modules' own forwards back (and weights freed to meta: their stored values)."""
        for module, dtype in self._freed:
            module.weight = nn.Parameter(as_dense(self.weights[module], dtype).clone(), requires_grad=False)
        self._freed.clear()
        restore_forwards(self._undo)
        self.weights.clear()


def dense_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear of ``model`` outside experts and routers (an offloaded MoE
    block's ``gate`` stays float and as it is, whatever its class: routing is not quantised)."""
    routers = {id(m.gate) for m in model.modules() if hasattr(m, "_runner") and hasattr(m, "gate")}
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".experts" not in n and id(m) not in routers]


def install_dense(model: nn.Module, dense_dtype: str, compute: torch.dtype, device: torch.device,
                  min_bytes: int | None = None) -> DensePath:
    """Give every dense Linear of ``model`` the native decode path and its ``--dense-dtype`` weight.

    ``min_bytes``: a float weight of fewer bytes is left as it is (None: :data:`MIN_NATIVE_BYTES`, read
    at the call, so tests can set it to 0 and run every weight of a tiny model natively).

    Raises:
        OptionError: a --dense-dtype this compute dtype or device cannot take (:func:`resolve_dense_dtype`).
    """
    fmt = resolve_dense_dtype(dense_dtype, compute, device)
    min_bytes = MIN_NATIVE_BYTES if min_bytes is None else min_bytes
    path = DensePath()
    chosen = [(n, m) for n, m in dense_linears(model)
              if m.weight.numel() * m.weight.element_size() >= min_bytes]  # smaller: as it is (a few KB)
    native = device.type == "cpu" and native_kernels.library() is not None
    stored: dict[nn.Module, object] = {}
    qkv, mlps = [], []
    if native:  # fused units (runtime/dense_call.py): one stored weight, each module a row slice of it
        linears = {m for _, m in chosen}
        qkv, mlps = dense_call.qkv_groups(model, linears), dense_call.mlp_groups(model, linears)
        for owner, parts in qkv + mlps:
            fused = _fused_weight([p.weight.detach() for p in parts], fmt)
            for p, w in zip(parts, dense_call.row_slices(fused, [p.out_features for p in parts])):
                stored[p] = w
            stored[owner] = fused
    ops = _custom_ops()
    for name, module in chosen:
        if module in stored:
            w = stored[module]
        elif fmt is None:  # the module's own weight: onto 2 MB pages in place
            if native:
                _weight_on_huge_pages(module)
            w = stored_weight(module.weight, fmt)
        else:
            w = stored_weight(module.weight, fmt)
            w = on_huge_pages(w) if native else w
        path.weights[module] = w
        path.native.add(name)
        path._undo.append((module, module.__dict__.get("forward")))
        module.forward = _forward(path, module, w, device.type == "cpu", ops)
    for owner, parts in qkv:
        dense_call.FusedQKV(path, parts, stored[owner], kl.max_tokens(stored[owner])).wrap(parts)
    for owner, _ in mlps:
        path._undo.append((owner, owner.__dict__.get("forward")))
        dense_call.FusedMLP(path, owner, stored[owner], kl.max_tokens(stored[owner])).wrap()
    path.fused = len(qkv) + len(mlps)
    _free_replaced(model, path, compute)
    return path


def on_huge_pages(w):
    """``w`` copied onto 2 MB pages (runtime/host/hugepages.py) when it is a CPU tensor of at least
    ``hugepages.MIN_BYTES`` (a LowBitWeight: its codes); otherwise ``w`` itself (small, on a device)."""
    if isinstance(w, LowBitWeight):
        codes = on_huge_pages(w.codes)
        return w if codes is w.codes else replace(w, codes=codes)
    if (w.device.type != "cpu" or not hugepages.enabled()
            or w.numel() * w.element_size() < hugepages.MIN_BYTES):
        return w
    return hugepages.copy(w)


def _fused_weight(weights: list[torch.Tensor], fmt) -> torch.Tensor | LowBitWeight:
    """The [sum R_i, C] concatenation of ``weights`` as ``fmt`` stores it, on 2 MB pages when large.
    Float (fmt None): concatenated straight into the huge-page buffer, so no temporary [R, C] copy is
    freed into the heap while the parts are still alive (RSS under a memory cap, host/heap_trim.py)."""
    rows, first = sum(w.shape[0] for w in weights), weights[0]
    nbytes = rows * first.shape[1] * first.element_size()
    if (fmt is None and first.device.type == "cpu" and hugepages.enabled()
            and nbytes >= hugepages.MIN_BYTES):
        return torch.cat(weights, out=hugepages.empty((rows, first.shape[1]), first.dtype))
    return on_huge_pages(stored_weight(torch.cat(weights), fmt))


def _weight_on_huge_pages(module: nn.Linear) -> None:
    """Move the float weight the auto ``--dense-dtype`` keeps as it is (the stored weight is the
    module's own Parameter, or a tied embedding's) onto 2 MB pages in place (``param.data``): every
    module sharing the Parameter reads the huge-page copy, and no second copy is kept."""
    data = module.weight.data
    moved = on_huge_pages(data)
    if moved is not data:
        module.weight.data = moved


def _free_replaced(model: nn.Module, path: DensePath, compute: torch.dtype) -> None:
    """Put on the meta device every float weight whose values now live in another stored weight (a
    fused copy, a bf16 / int8 one), so host memory holds each weight once; a weight shared with the
    input embeddings (tied lm_head) stays. ``uninstall`` puts the stored values back."""
    emb = model.get_input_embeddings().weight
    for module, w in path.weights.items():
        weight = module.weight
        if weight.device.type == "meta" or weight is emb or weight.data_ptr() == emb.data_ptr():
            continue
        if isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
            continue  # the stored weight is this weight (no copy was made)
        path._freed.append((module, compute))
        module.weight = nn.Parameter(weight.detach().to("meta"), requires_grad=False)


def _forward(path: DensePath, module: nn.Linear, w, native: bool, ops):
    """The forward of one wrapped Linear: x [..., C] -> [..., R] in x's dtype (``ops``: :func:`_custom_ops`,
    registered before any tracing)."""
    bias, rows = module.bias, kl.rows_of(w)
    limit = kl.max_tokens(w) if native else -1
    bound = spin.BoundWeight(w) if native and spin.bindable(w) else None
    lowbit = isinstance(w, LowBitWeight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [T, C]
        if path.reference or x2.shape[0] > limit:
            return F.linear(x, as_dense(w, x.dtype), bias)
        if torch.compiler.is_compiling():
            y = _op(ops, x2, w)
        elif bound is None or (not lowbit and torch.get_num_threads() > 1):
            # several intra-op threads outside the thread plan: F.linear uses them (as kernels.linear.plan)
            return F.linear(x, as_dense(w, x.dtype), bias)
        else:
            path.calls += 1
            y = bound.linear(x2.float().contiguous(), spin.active())  # [T, R] float32
            if x.dtype != torch.float32:
                y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], rows)

    return forward


def _op(ops, x: torch.Tensor, w) -> torch.Tensor:
    """The native product as a custom op (under torch.compile): x [T, C] -> [T, R]."""
    if isinstance(w, LowBitWeight):
        return ops[1](x, w.codes, w.scales, w.zeros, w.bits, w.rows, w.cols, w.group_size)
    return ops[0](x, w)


@functools.cache
def _custom_ops():
    """Register ``moespec::dense_gemv`` (float weight) and ``moespec::dense_gemv_q`` (low-bit) once."""

    @torch.library.custom_op("moespec::dense_gemv", mutates_args=())
    def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kl.linear(x, w) if kl.plan(x, w) != "gemm" else F.linear(x, w.to(x.dtype))

    @gemv.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.custom_op("moespec::dense_gemv_q", mutates_args=())
    def gemv_q(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               rows: int, cols: int, group: int) -> torch.Tensor:
        return kl.linear(x, LowBitWeight(bits, rows, cols, group, codes, scales, zeros))

    @gemv_q.register_fake
    def _(x, codes, scales, zeros, bits, rows, cols, group):
        return x.new_empty(x.shape[0], rows)

    return gemv, gemv_q
