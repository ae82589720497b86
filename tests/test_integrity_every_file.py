"""Every safetensors file moespec writes for itself, damaged every way, is refused or rebuilt.

One table (KINDS) names each kind of file moespec reads back, its writer and its reader; each fault
runs over the whole table: one flipped bit at the first, a middle and the last byte of the tensor
data (the header intact, so only the data checksum can tell), truncation at four points, and NaN,
+inf and -inf written with a valid checksum (so only the finiteness check can tell). A user's file
(calibration, estimator, estimator states) is refused with one message naming the file; a cache
(the quantised store, the default-model build's checkpoints) is not used: it is rebuilt.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

import writers
from moespec.errors import CalibrationError, DataError
from moespec.estimator.states import load_shard, read_vectors, save_vectors
from moespec.integrity import DIGEST_KEY, digest_metadata, per_tensor_digests, with_digest
from moespec.predict.calibration_file import load_calibration
from moespec.predict.estimator_file import load_estimator

CACHE = "not used (rebuilt)"


def _why(read, error: type, *args) -> str | None:
    """None when ``read(*args)`` takes the file, else the one message of the ``error`` it raised."""
    try:
        read(*args)
    except error as exc:
        return exc.message
    return None


def _calibration_read(path: Path) -> str | None:
    return _why(load_calibration, CalibrationError, path)


def _estimator_read(path: Path) -> str | None:
    return _why(load_estimator, CalibrationError, path)


def _shard_read(path: Path) -> str | None:
    return _why(load_shard, DataError, path, [0], ("state", "logits"))


def _vectors_write(path: Path) -> None:
    save_vectors(path.parent, torch.randn(3, 4, 8))


def _vectors_read(path: Path) -> str | None:
    return _why(lambda folder: read_vectors(folder).shape, DataError, path.parent)  # None (no file) fails too


class _Layout:
    """What the quantised store's finiteness check reads of a QuantLayout: the first 4 bytes of a
    row are its float16 scales."""

    def part_shapes(self) -> dict:
        return {"gate_up_scales": (2,), "down_scales": (2,)}


class _Store:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.layout = buffer, _Layout()


QUANT_META = {"format": 2, "bits": 4}


def _quant_write(path: Path) -> None:
    from moespec.runtime.host.quant_store import QuantStoreCache

    gen = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (2, 4, 64), dtype=torch.uint8, generator=gen)
    buf[..., :4] = torch.tensor([1.0, 0.5], dtype=torch.float16).view(torch.uint8)  # finite scales
    assert QuantStoreCache(path, QUANT_META).save(_Store(buf)) is None


def _quant_read(path: Path) -> str | None:
    from moespec.runtime.host.quant_store import QuantStoreCache

    store = _Store(torch.zeros(2, 4, 64, dtype=torch.uint8))
    return None if QuantStoreCache(path, QUANT_META).load_into(store) else CACHE


def _build_write(path: Path) -> None:
    from moespec.default_model.checkpoints import LayerCheckpoints

    LayerCheckpoints(path.parent, "digest").open()
    writers.build_checkpoint(path.parent / "layer-00.safetensors")


def _build_read(path: Path) -> str | None:
    from moespec.default_model.checkpoints import LayerCheckpoints

    if LayerCheckpoints(path.parent, "digest").open() == 1:
        return None
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]  # the damaged layers are gone
    return CACHE


# kind -> (file name, write(path), read(path) -> None when used, else why not)
KINDS = {
    "calibration": ("c.safetensors", writers.calibration, _calibration_read),
    "estimator": ("e.safetensors", writers.estimator, _estimator_read),
    "states_shard": ("train-00000.safetensors", writers.states_shard, _shard_read),
    "states_vectors": ("vectors.safetensors", _vectors_write, _vectors_read),
    "quant_store": ("int4-g64.safetensors", _quant_write, _quant_read),
    "build_layer": ("layer-00.safetensors", _build_write, _build_read),
    "build_hidden": ("hidden.safetensors", _build_write, _build_read),
}
USER_FILES = {"calibration", "estimator", "states_shard", "states_vectors"}


@pytest.fixture(params=sorted(KINDS))
def written(request, tmp_path) -> tuple[str, Path]:
    kind = request.param
    name, write, read = KINDS[kind]
    path = tmp_path / kind / name
    path.parent.mkdir()
    write(path)
    assert read(path) is None, f"the intact {kind} file is not used"  # so every refusal below is the fault's
    return kind, path


def _header_bytes(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _refused(kind: str, path: Path, *words: str) -> None:
    why = KINDS[kind][2](path)
    assert why is not None, f"the damaged {kind} file was used"
    if kind in USER_FILES:  # one message, naming the file and what is wrong with it
        assert "\n" not in why and (str(path) in why or path.name in why), why
        assert any(w in why for w in words), why
    else:
        assert why == CACHE


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_bit_anywhere_in_the_data_is_found(written, where):
    kind, path = written
    data = bytearray(path.read_bytes())
    start = _header_bytes(path)
    at = {"first": start, "middle": (start + len(data)) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    _refused(kind, path, "checksum", "corrupt", "not finite", "NaN")


@pytest.mark.parametrize("cut", ["in_the_length", "in_the_header", "after_the_header", "last_byte"])
def test_a_truncated_file_is_found(written, cut):
    kind, path = written
    data = path.read_bytes()
    head = _header_bytes(path)
    keep = {"in_the_length": 5, "in_the_header": head // 2, "after_the_header": head + 1,
            "last_byte": len(data) - 1}[cut]
    path.write_bytes(data[:keep])
    _refused(kind, path, "truncated")


def _reseal(path: Path, poison) -> None:
    """Rewrite ``path`` with ``poison(tensors)`` applied and a checksum that matches the new data, in
    the form the file had (one digest in its JSON entry, a digest key of its own, or one per tensor)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = dict(fh.metadata() or {})
    poison(tensors)
    if DIGEST_KEY in meta:
        per_tensor = meta[DIGEST_KEY].startswith("{")
        meta.update(per_tensor_digests(tensors) if per_tensor else digest_metadata(tensors))
    else:
        (key,) = [k for k, v in meta.items() if DIGEST_KEY in json.loads(v)]
        entry = json.loads(meta[key])
        entry.pop(DIGEST_KEY)
        meta[key] = json.dumps(with_digest(entry, tensors), sort_keys=True)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_or_inf_written_with_a_valid_checksum_is_refused(written, value):
    kind, path = written

    def poison(tensors: dict) -> None:
        if kind == "quant_store":  # the rows are bytes; their first float16 is a scale
            tensors["experts"][0, 0, :2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
            return
        name = next(k for k in sorted(tensors) if tensors[k].is_floating_point() and "recall" not in k)
        tensors[name].view(-1)[0] = value  # (recall metrics may hold NaN: "no predictor for this layer")

    _reseal(path, poison)
    _refused(kind, path, "NaN", "infinite", "not finite")


def test_the_scales_bit_test_agrees_with_isfinite():
    """The quantised store's fast finiteness test (exponent bits) against torch.isfinite, over float16
    bit patterns of every kind: finite (subnormals, -0, the largest), NaN (quiet, signalling, signed), ±inf."""
    from moespec.runtime.host.quant_store import _scales_finite, scales_finite_reference

    gen = torch.Generator().manual_seed(1)
    special = [0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x3C00, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7FFF]
    for trial in range(200):
        buf = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=gen)
        scales = buf[..., :4].view(torch.int16)  # [3, 4, 2] the two float16 scales of every row
        scales.copy_(torch.tensor(0x3C00, dtype=torch.int16))  # 1.0 everywhere ...
        if trial % 4:  # ... then some rows get a special pattern (a quarter of the trials stay all finite)
            for _ in range(1 + trial % 3):
                m, e, k = (int(torch.randint(0, d, (1,), generator=gen)) for d in (3, 4, 2))
                pick = special[int(torch.randint(0, len(special), (1,), generator=gen))]
                scales[m, e, k] = pick - 0x10000 if pick >= 0x8000 else pick
        store = _Store(buf)
        assert _scales_finite(store) == scales_finite_reference(store), scales
