"""ExpertBatch (one host dispatch per layer): split by experts or by rows, the same outputs, no waiting on idle workers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moespec.kernels import native
from moespec.kernels.expert_batch import ExpertBatch, ExpertJob, Split, choose_split
from moespec.models.quant_layout import QuantLayout

pytestmark = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
ACT = torch.nn.functional.silu


def _jobs(layout, tokens: list[int], seed: int = 0) -> list[ExpertJob]:
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for t in tokens:
        row = torch.randint(0, 256, (layout.numel,), dtype=torch.uint8, generator=gen)
        for name in ("gate_up_scales", "down_scales"):
            layout.views(row)[name].view(torch.float16).fill_(0.01)
        x = torch.randn(t, layout.hidden, generator=gen)
        jobs.append(ExpertJob(x, layout.linear_weights(row), glu=lambda g: layout.act_and_mul(g, ACT),
                              act_int8=layout.act_int8,
                              forward=lambda xh, row=row: layout.forward(xh, row, ACT)))
        jobs[-1].row = row  # for the reference below
    return jobs


def _run(jobs, split: Split, workers: int):
    batch = ExpertBatch(jobs, split, workers)
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(min(workers, batch.num_units)):
            pool.submit(batch.run)
        return batch, batch.future.result(timeout=60)


@pytest.mark.parametrize("bits,act_int8", [(4, False), (8, False), (4, True)])
def test_rows_and_experts_splits_equal_the_layout_forward(bits, act_int8):
    layout = QuantLayout(hidden=96, intermediate=48, bits=bits, group_size=32, act_int8=act_int8)
    jobs = _jobs(layout, [1, 3, 1])
    want = [layout.forward(j.x, j.row, ACT) for j in jobs]
    for split, workers in ((Split.EXPERTS, 2), (Split.ROWS, 3), (Split.ROWS, 1)):
        batch, done = _run(jobs, split, workers)
        assert batch.split == split
        for d, w in zip(done, want):
            # the one-call kernel (EXPERTS) and the row ranges (ROWS) run the same row kernels and
            # the same C SiLU: bit-equal either way
            assert torch.equal(d.y, w)
            assert d.busy_s > 0 and d.end >= d.start


def test_auto_split_fills_every_worker():
    assert choose_split(Split.AUTO, 8, 2) == Split.EXPERTS  # 4 each
    assert choose_split(Split.AUTO, 3, 2) == Split.ROWS  # 2 + 1 would leave a worker idle half the time
    assert choose_split(Split.AUTO, 5, 2) == Split.EXPERTS  # >= 2 per worker: close enough
    assert choose_split(Split.AUTO, 1, 4) == Split.ROWS
    assert choose_split(Split.AUTO, 1, 1) == Split.EXPERTS


def test_the_future_resolves_without_waiting_for_a_worker_with_nothing_to_do():
    """All units done by one worker: the batch resolves although a second worker never started."""
    layout = QuantLayout(hidden=32, intermediate=16, bits=4)
    batch = ExpertBatch(_jobs(layout, [1, 1]), Split.EXPERTS, workers=2)
    batch.run()  # the caller's thread takes every unit; nobody calls run() a second time
    assert batch.future.done() and len(batch.future.result()) == 2
    batch.run()  # a late worker returns at once
    assert batch.num_units == 2


def test_a_failing_unit_fails_the_batch_and_releases_waiting_units():
    layout = QuantLayout(hidden=32, intermediate=16, bits=4)
    jobs = _jobs(layout, [1, 1])

    def boom(g):
        raise RuntimeError("glu failed")

    jobs[0].glu = boom
    batch = ExpertBatch(jobs, Split.ROWS, workers=2)
    threads = [threading.Thread(target=batch.run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="glu failed"):
        batch.future.result(timeout=1)
