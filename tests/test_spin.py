"""Bound weights and the spinning row pool (kernels/spin.py, csrc/spin.c).

  - a bound product equals the reference (F.linear on the dequantised weight) within float32
    rounding, for float32, bfloat16, int8 and int4 weights at 1, 3 and 9 tokens;
  - split over a pool it equals the serial bound product bit for bit (row counts that are not a
    multiple of the chunk, one and two workers), also after the workers have gone to sleep;
  - many products in a row through one pool stay bit-equal (no chunk of one job runs with another's
    pointers);
  - close is idempotent and a closed pool runs serially;
  - the read-ahead (each product's workers read the next product's weight) learns the order the
    products ran in, keeps the next weight alive, never changes a value (on and off, any split
    threshold), and ``quiet`` returns.
"""

from __future__ import annotations

import time

import pytest
import torch
from lowbit_weights import random_lowbit

from moespec.kernels import linear as L
from moespec.kernels import native, spin
from moespec.kernels.lowbit import LowBitWeight

needs_kernels = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")


def _weights():
    gen = torch.Generator().manual_seed(5)
    yield torch.randn(1003, 320, generator=gen)
    yield torch.randn(517, 256, generator=gen).bfloat16()
    yield random_lowbit(8, 1001, 256, 64)
    yield random_lowbit(4, 999, 320, 64)


def _cols(w) -> int:
    return w.cols if isinstance(w, LowBitWeight) else w.shape[1]


@pytest.fixture(params=[1, 2])
def pool(request):
    p = spin.SpinPool(request.param)
    yield p
    p.close()


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_bound_equals_reference(tokens):
    for w in _weights():
        x = torch.randn(tokens, _cols(w))
        got = spin.BoundWeight(w).linear(x)
        ref = L.linear_reference(x, w if isinstance(w, LowBitWeight) else w.float())
        assert got.shape == (tokens, L.rows_of(w))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_split_bit_equal(pool, tokens):
    for w in _weights():
        b = spin.BoundWeight(w)
        x = torch.randn(tokens, _cols(w))
        assert torch.equal(b.linear(x, pool), b.linear(x))


@needs_kernels
def test_after_sleep_and_many_jobs(pool):
    ws = [spin.BoundWeight(w) for w in _weights()]
    xs = [torch.randn(1, b.cols) for b in ws]
    want = [b.linear(x) for b, x in zip(ws, xs)]
    time.sleep(0.01)  # the workers spin 2 ms, then sleep: the next job must wake them
    for i in range(400):
        k = i % len(ws)
        assert torch.equal(ws[k].linear(xs[k], pool), want[k])


@needs_kernels
def test_close_idempotent_and_serial_after():
    p = spin.SpinPool(1)
    b = spin.BoundWeight(torch.randn(64, 32))
    x = torch.randn(1, 32)
    p.close()
    p.close()
    assert torch.equal(b.linear(x, p), b.linear(x))


@needs_kernels
def test_refuses_what_it_cannot_bind():
    assert not spin.bindable(torch.randn(4, 4, dtype=torch.float64))
    assert not spin.bindable(torch.randn(4, 8).t())
    with pytest.raises(ValueError):
        spin.BoundWeight(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        spin.SpinPool(0)


@needs_kernels
@pytest.mark.parametrize("split_min", [0, 1 << 40])
def test_read_ahead_learns_the_order_and_changes_nothing(pool, split_min):
    ws = [spin.BoundWeight(w) for w in _weights()]
    xs = [torch.randn(1, b.cols) for b in ws]
    want = [b.linear(x) for b, x in zip(ws, xs)]
    pool.set_split_min_bytes(split_min)
    for ahead in (True, False, True):
        pool.read_ahead = ahead
        for _ in range(50):
            for b, x, y in zip(ws, xs, want):
                assert torch.equal(b.linear(x, pool), y)
        pool.quiet()
    for b, nxt in zip(ws, ws[1:] + ws[:1]):  # each product reads the one after it (the last: the first)
        assert b._next[0][0] is nxt._ranges


@needs_kernels
def test_read_ahead_keeps_the_next_weight_alive(pool):
    first = spin.BoundWeight(torch.randn(512, 256))
    x = torch.randn(1, 256)
    second = spin.BoundWeight(torch.randn(1024, 256))
    first.linear(x, pool), second.linear(x, pool)  # first now reads second's weight ahead
    kept = second.weight
    del second
    want = first.linear(x)
    for _ in range(20):  # the read-ahead of the freed BoundWeight's weight: still alive, no fault
        assert torch.equal(first.linear(x, pool), want)
    pool.quiet()
    assert first._next[0][1][0] is kept
