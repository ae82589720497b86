"""CPU kernels for Linear-shaped weights: float32 / bfloat16 GEMV and fused int8 / int4 dequantise-and-multiply.

- :mod:`moespec.kernels.lowbit`: the low-bit weight format (groups along the input dimension, the
  int4 nibble order), packing and dequantisation in torch (any device).
- :mod:`moespec.kernels.linear`: ``linear(x, w)`` on the fastest path, ``linear_reference`` beside it,
  and the row-split form threads use.
- :mod:`moespec.kernels.native`: the C kernels (csrc/*.c), built on first use, or why not.
"""
