"""The quantised store's fast check (rows read straight into the buffer, then hashed and
scale-checked in one hand-over on a second thread, or inline) against its slow reference
(safetensors reads the whole tensor, then the digest of the whole buffer and torch.isfinite):
both take the intact file and both refuse every flipped bit, byte by byte over the whole file
(header, scales, packed weights, the last byte), every cut and an appended tail.
"""

from __future__ import annotations

import struct

import pytest
import torch

from moespec.runtime.host.quant_store import QuantStoreCache

META = {"format": 3, "bits": 4}
SHAPE = (2, 5, 40)  # [M, E, P]: 10 rows of 40 bytes; the first 8 bytes of a row are 4 float16 scales


class _Layout:
    def part_shapes(self) -> dict:
        return {"gate_up_scales": (6,), "down_scales": (2,)}


class _Store:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.layout = buffer, _Layout()


@pytest.fixture
def written(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=gen)
    rows[..., :8] = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float16).view(torch.uint8)
    path = tmp_path / "int4-g64.safetensors"
    assert QuantStoreCache(path, META).save(_Store(rows)) is None
    return path, rows


def _verdicts(path) -> dict[str, bool]:
    cache = QuantStoreCache(path, META)
    out = {}
    for name, load in {"overlap": cache.load_into, "inline": lambda s: cache.load_into(s, overlap=False),
                       "reference": cache.load_into_reference}.items():
        out[name] = load(_Store(torch.zeros(SHAPE, dtype=torch.uint8)))
    return out


def test_the_intact_file_is_taken_by_both_with_the_same_rows(written):
    path, rows = written
    cache = QuantStoreCache(path, META)
    fast, slow = _Store(torch.zeros(SHAPE, dtype=torch.uint8)), _Store(torch.zeros(SHAPE, dtype=torch.uint8))
    pending = cache.start_load(fast)
    assert pending is not None and pending.wait() and pending.wait()  # idempotent
    assert cache.load_into_reference(slow)
    assert torch.equal(fast.buffer, rows) and torch.equal(slow.buffer, rows)


def test_every_flipped_bit_of_the_file_is_refused_by_both(written):
    path, _ = written
    data = path.read_bytes()
    head = 8 + struct.unpack("<Q", data[:8])[0]
    regions = {"length": range(0, 8), "header": range(8, head), "scales": range(head, head + 8),
               "weights": range(head + 8, head + SHAPE[2]), "last_row": range(len(data) - SHAPE[2], len(data))}
    for region, where in regions.items():
        for at in where:
            damaged = bytearray(data)
            damaged[at] ^= 0x01 if region != "length" else 0x40  # (bit 0 of the length: a 1-byte cut)
            path.write_bytes(bytes(damaged))
            assert _verdicts(path) == {"overlap": False, "inline": False, "reference": False}, (region, at)


@pytest.mark.parametrize("cut", [0, 5, 100, -41, -40, -1])
def test_a_cut_or_an_appended_tail_is_refused_by_both(written, cut):
    path, _ = written
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    assert _verdicts(path) == {"overlap": False, "inline": False, "reference": False}
    path.write_bytes(data + b"\0")
    assert _verdicts(path) == {"overlap": False, "inline": False, "reference": False}


def test_a_nan_scale_in_the_last_row_is_refused_by_both(written):
    """Written with a valid checksum: only the scales check can tell, in the last row of the buffer."""
    path, rows = written
    bad = rows.clone()
    bad[1, 4, 6:8] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)  # the last row's last scale
    assert QuantStoreCache(path, META).save(_Store(bad)) is None
    assert _verdicts(path) == {"overlap": False, "inline": False, "reference": False}


def test_the_check_runs_on_a_second_thread_and_reraises_there():
    """BackgroundCheck: the hash and the check run off the caller's thread, once, over the whole
    buffer; an error raised there is raised by wait(), every time."""
    import threading

    from moespec.integrity import BackgroundCheck, new_hasher

    data = bytes(range(256)) * 4096
    seen = []

    def check() -> bool:
        seen.append(threading.get_ident())
        return True

    h, ref = new_hasher(), new_hasher()
    job = BackgroundCheck.run(data, h, check)
    assert job.wait() and job.wait() and len(seen) == 1 and seen[0] != threading.get_ident()
    ref.update(data)
    assert h.hexdigest() == ref.hexdigest()

    def broken() -> bool:
        raise ValueError("bad")

    job = BackgroundCheck.run(data, None, broken)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            job.wait()
    idle = BackgroundCheck()  # started before a read that then failed: ends without work
    idle.cancel()
    assert idle.wait() is False
