"""y = x @ W.T for one Linear-shaped weight on the CPU, by the native kernels, with the reference beside them.

Shapes: T tokens, R rows (output features), C columns (input features), G groups per row.

This is the API for every Linear-shaped weight (routed experts today; dense layers can use it the
same way): ``w`` is a float32 or bfloat16 tensor [R, C] or a :class:`~moespec.kernels.lowbit.LowBitWeight`.

  - :func:`linear` (x [T, C] float32 or bfloat16 -> [T, R] in x's dtype): the fast path.
  - :func:`linear_reference`: the slow reference it is tested against (dequantise, then F.linear).
  - :func:`prepare` + :func:`run_rows` + :func:`finish`: the same product split by output rows, for
    threads (each call computes rows [r0, r1) and releases the GIL while the kernel runs).

Threads (runtime/threads.ThreadPlan): inside a decode step with ``--threads`` > 1 the compute thread
has one intra-op thread and a RowPool (kernels/row_pool.py) is active; :func:`linear` then cuts a
weight of at least SPLIT_MIN_BYTES into row chunks that the caller and the pool's idle workers
compute together. Bit-equal to the unsplit product (a row's sum does not depend on its chunk).

Which kernel runs (:func:`plan`):
  - t <= FUSED_MAX_TOKENS (float32 weights: FUSED_MAX_TOKENS_F32), CPU tensors, kernels loaded: the native GEMV (csrc/): the weight is
    read once, low-bit codes are dequantised in registers. float32 activations: exact (float32
    accumulation; the order of the sum differs from F.linear's, ~1e-7 relative). bfloat16 activations
    are computed in float32 and rounded once (as F.linear does in bfloat16).
  - ``act_int8`` (``--expert-dtype w8a8|w4a8``) and a low-bit weight: each token's activations are
    quantised to int8 per weight group (scale max|x| / 127) and the products are integer: not exact;
    relative error of an output ~ 2**-8 / sqrt(group) (measured in tests/test_kernels.py).
  - more tokens (prefill chunks), or no kernels: float weights go to F.linear; low-bit ones are
    dequantised (natively when possible, bit-equal to the reference) and go to F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.kernels import native, row_pool
from moespec.kernels.lowbit import LowBitWeight, dequantize

# Above this many tokens a GEMM on dequantised weights beats the kernels (see README "Host
# experts"): prefill chunks go to F.linear. Since the token tiles (csrc/tiles.c: each weight read
# once and broadcast against 8 or 16 tokens) float32 rows too stay on the kernels up to 16 tokens:
# one thread, a Qwen3-30B-A3B expert at t = 16 from memory, 3.08 / 3.24 ms in the tiles against
# 4.63 / 4.20 ms through F.linear (MKL) (scripts/host_expert_bench.py, two paired runs, exclusive lock).
FUSED_MAX_TOKENS = 16
FUSED_MAX_TOKENS_F32 = 16  # kept as a name (swiglu.py and callers read it); was 8 before the tiles
# A product is split over the row pool's workers from this many weight bytes on, in chunks of about
# CHUNK_BYTES (at most MAX_CHUNKS). Measured (docs/decisions.md 2026-12-02 "A thread plan for
# decode"): waking a sleeping worker costs ~50 us on this idle VM, so splitting lost on every
# product of 1-5 MB (q 1.3 MB 140 -> 199 us, down 2.4 MB 213 -> 256, gate_up 4.7 MB 365 -> 334) and
# won on lm_head (113 MB, 10.3 -> 6.1 ms); end to end a 1 MiB threshold was 0.78x one thread, 16 MiB 0.91x.
SPLIT_MIN_BYTES = 16 << 20
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 16
_KIND = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16}


@dataclass
class Prepared:
    """Activations made ready for one weight's kernel (shared by every row range).

    Attributes:
        mode: "fused" (GEMV kernel, exact), "a8" (int8 activations) or "gemm" (F.linear).
        x: [T, C] float32 contiguous ("fused"; "gemm": x as given).
        xs: [T, G] float32 group sums, or None (the t = 1 low-bit kernel computes them).
        a8: (xq int8 [T, C], scales d [T, G], sums of xq [T, G]) for "a8".
        out_dtype: x's dtype (the result's).
    """

    mode: str
    x: torch.Tensor
    xs: torch.Tensor | None = None
    a8: tuple | None = None
    out_dtype: torch.dtype = torch.float32


def _weight_ok(w) -> bool:
    if isinstance(w, LowBitWeight):
        return w.device.type == "cpu"
    return w.device.type == "cpu" and w.dtype in _KIND and w.is_contiguous()


def max_tokens(w) -> int:
    """The most tokens the kernels take for ``w`` (more: F.linear)."""
    return FUSED_MAX_TOKENS_F32 if isinstance(w, torch.Tensor) and w.dtype == torch.float32 else FUSED_MAX_TOKENS


def plan(x: torch.Tensor, w, act_int8: bool = False) -> str:
    """Which path :func:`linear` takes for x [T, C] and ``w``: "fused", "a8" or "gemm".

    A float weight on a thread with several torch intra-op threads (a CPU run's compute thread with
    --threads > 1) keeps F.linear, which uses them; the kernels run on one thread (the host pool's
    workers run one intra-op thread each, so they take the kernels).
    """
    if (x.shape[0] > max_tokens(w) or x.device.type != "cpu" or x.dtype not in _KIND or not _weight_ok(w)
            or native.library() is None or (not isinstance(w, LowBitWeight) and torch.get_num_threads() > 1)):
        return "gemm"
    return "a8" if act_int8 and isinstance(w, LowBitWeight) else "fused"


def prepare(x: torch.Tensor, w, act_int8: bool = False) -> Prepared:
    """Activations x [T, C] made ready for ``w`` (see :class:`Prepared`)."""
    mode = plan(x, w, act_int8)
    if mode == "gemm":
        return Prepared(mode, x, out_dtype=x.dtype)
    lib = native.library()
    x32 = x.float().contiguous()  # [T, C] (no copy for contiguous float32)
    t, c = x32.shape
    if not isinstance(w, LowBitWeight):
        return Prepared(mode, x32, out_dtype=x.dtype)
    if mode == "a8":
        g, n = w.group_size, w.groups
        xq, d, qsum = torch.empty(t, c, dtype=torch.int8), torch.empty(t, n), torch.empty(t, n)
        lib.quantize_act(x32.data_ptr(), t, c, c, g, xq.data_ptr(), d.data_ptr(), qsum.data_ptr())
        return Prepared(mode, x32, a8=(xq, d, qsum), out_dtype=x.dtype)
    return Prepared(mode, x32, out_dtype=x.dtype)  # t = 1: the kernel sums x per group itself


def run_rows(p: Prepared, w, y: torch.Tensor, r0: int, r1: int) -> None:
    """Write rows [r0, r1) of the product into y [T, R] (float32 for "fused"/"a8", else x's dtype).

    Raises:
        MemoryError: the kernel could not allocate its scratch rows.
    """
    if r0 >= r1:
        return
    if p.mode == "gemm":
        y[:, r0:r1] = F.linear(p.x, _dense_rows(w, r0, r1, p.x.dtype))
        return
    lib, t = native.library(), p.x.shape[0]
    if not isinstance(w, LowBitWeight):
        rc = lib.linear_f32act(_KIND[w.dtype], p.x.data_ptr(), t, p.x.shape[1], w.data_ptr(), None, None, None,
                               w.shape[1], 0, y.data_ptr(), y.shape[1], r0, r1)
    elif p.mode == "a8":
        xq, d, qsum = p.a8
        kind = native.KIND_Q4 if w.bits == 4 else native.KIND_Q8
        rc = lib.linear_a8(kind, xq.data_ptr(), d.data_ptr(), qsum.data_ptr(), t, w.codes.data_ptr(),
                           w.scales.data_ptr(), w.zeros.data_ptr(), w.cols, w.group_size, y.data_ptr(), y.shape[1],
                           r0, r1)
    else:
        kind = native.KIND_Q4 if w.bits == 4 else native.KIND_Q8
        rc = lib.linear_f32act(kind, p.x.data_ptr(), t, p.x.shape[1], w.codes.data_ptr(), w.scales.data_ptr(),
                               w.zeros.data_ptr(), None if p.xs is None else p.xs.data_ptr(), w.cols, w.group_size,
                               y.data_ptr(), y.shape[1], r0, r1)
    if rc != 0:
        raise MemoryError("the CPU kernel could not allocate its scratch rows")


def _dense_rows(w, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [r0, r1) of ``w`` as a dense [r1 - r0, C] tensor in ``dtype`` (low-bit: dequantised)."""
    if not isinstance(w, LowBitWeight):
        return w[r0:r1].to(dtype)
    lib = native.library()
    if lib is None or w.device.type != "cpu":
        return dequantize(_row_slice(w, r0, r1), dtype)
    out = torch.empty(r1 - r0, w.cols)
    fn = lib.dequant_q4 if w.bits == 4 else lib.dequant_q8
    fn(w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), w.cols, w.group_size, out.data_ptr(), r0, r1)
    return out.to(dtype)


def _row_slice(w: LowBitWeight, r0: int, r1: int) -> LowBitWeight:
    per, n = w.cols * w.bits // 8, w.groups
    return LowBitWeight(w.bits, r1 - r0, w.cols, w.group_size, w.codes[r0 * per : r1 * per],
                        w.scales[r0 * n : r1 * n], w.zeros[r0 * n : r1 * n])


def new_output(p: Prepared, rows: int) -> torch.Tensor:
    """An uninitialised y [T, rows] for :func:`run_rows`."""
    dtype = p.out_dtype if p.mode == "gemm" else torch.float32
    return torch.empty(p.x.shape[0], rows, dtype=dtype, device=p.x.device)


def finish(p: Prepared, y: torch.Tensor) -> torch.Tensor:
    """y in x's dtype (one rounding for bfloat16 activations)."""
    return y.to(p.out_dtype)


def rows_of(w) -> int:
    """R of ``w``."""
    return w.rows if isinstance(w, LowBitWeight) else w.shape[0]


def nbytes(w) -> int:
    """Bytes one product with ``w`` reads (low-bit: codes, scales and zeros)."""
    if isinstance(w, LowBitWeight):
        return sum(t.numel() * t.element_size() for t in (w.codes, w.scales, w.zeros))
    return w.numel() * w.element_size()


def chunk_count(w) -> int:
    """How many row chunks :func:`linear` cuts ``w`` into under a RowPool (1: not split)."""
    b = nbytes(w)
    return 1 if b < SPLIT_MIN_BYTES else max(2, min(MAX_CHUNKS, b // CHUNK_BYTES))


def linear(x: torch.Tensor, w, act_int8: bool = False) -> torch.Tensor:
    """x [T, C] @ w.T -> [T, R] in x's dtype, on the fastest path (see the module docstring).

    Under an active RowPool (a decode step of the thread plan) a big weight's rows are computed by
    the caller and the pool's idle workers together; the result is the same bits.
    """
    p = prepare(x, w, act_int8)
    if p.mode == "gemm":
        return F.linear(x, _dense_rows(w, 0, rows_of(w), x.dtype) if isinstance(w, LowBitWeight) else w)
    rows = rows_of(w)
    y = new_output(p, rows)
    pool = row_pool.active()
    parts = 1 if pool is None else chunk_count(w)
    if parts > 1:
        pool.split(lambda r0, r1: run_rows(p, w, y, r0, r1), rows, parts)
    else:
        run_rows(p, w, y, 0, rows)
    return finish(p, y)


def linear_serial(x: torch.Tensor, w, act_int8: bool = False) -> torch.Tensor:
    """:func:`linear` on this thread alone (no RowPool): the reference its row split is tested against."""
    with row_pool.using(None):
        return linear(x, w, act_int8)


def quantize_act_codes_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes [T, C] and scales d [T, G] (float32) the "a8" kernels compute for x [T, C].

    Per token and group: d = max|x| / 127, codes round_half_even(x * (127 / max|x|)) clamped to
    [-127, 127] (0 where max|x| = 0): csrc/a8.c's quantize_act, bit for bit. 127 / max|x| is one
    true division as in C (``scalar / tensor`` in torch is reciprocal-then-multiply, two roundings,
    which moved a tie to the other code ~1 time in 10**5).
    """
    t, c = x.shape
    n = -(-c // group_size)
    xp = F.pad(x.float(), (0, n * group_size - c)).view(t, n, group_size)
    amax = xp.abs().amax(-1, keepdim=True)  # [T, G, 1]
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(xp * inv).clamp_(-127, 127)  # torch.round: half to even, as vcvtps2dq
    return q.view(t, -1)[:, :c].to(torch.int8), (amax / 127.0).view(t, n)


def quantize_act_reference(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The activations the "a8" kernels multiply: x [T, C] quantised per group to int8 and back, float32.

    Value code * scale, codes and scales from :func:`quantize_act_codes_reference`.
    """
    t, c = x.shape
    q, d = quantize_act_codes_reference(x, group_size)
    n = d.shape[1]
    qp = F.pad(q.float(), (0, n * group_size - c)).view(t, n, group_size)
    return (qp * d.view(t, n, 1)).view(t, -1)[:, :c]


def linear_reference(x: torch.Tensor, w, act_int8: bool = False) -> torch.Tensor:
    """Slow reference of :func:`linear`: dequantise (torch ops), then F.linear in x's dtype.

    With ``act_int8``, a low-bit weight and t <= FUSED_MAX_TOKENS, the activations are first quantised as the "a8" kernels
    quantise them (:func:`quantize_act_reference`) and the product is float32.
    """
    if not isinstance(w, LowBitWeight):
        return F.linear(x, w)
    if act_int8 and x.shape[0] <= FUSED_MAX_TOKENS:  # as linear: prefill chunks are exact
        return F.linear(quantize_act_reference(x, w.group_size), dequantize(w, torch.float32)).to(x.dtype)
    return F.linear(x, dequantize(w, x.dtype))
