"""QuantStoreCache: the quantised expert store kept on disk, so the second start does not quantise again.

Shapes: M MoE layers, E experts, P bytes per packed expert row (QuantLayout.numel).

File: ``<moespec home>/experts/<model id>/int4-g64.safetensors`` (moespec.artifacts.quant_store_path), one tensor ``experts`` [M, E, P] uint8 - the store's buffer as is - and a JSON header entry
``moespec_quant_store`` with the settings (format version, bits, group size, H, I, E, MoE layers)
and the checkpoint's fingerprint: for config.json and every shard, its name, size, mtime and the
sha256 of the safetensors header (tensor names, dtypes, shapes, offsets). Reading the header costs
a few kB per shard, never the weights.

A file whose header differs in anything (checkpoint changed, other settings, older format), that
cannot be read (truncated), whose data does not match the XXH3-128 checksum in its header (a flipped
byte; moespec.integrity, checked on a second thread once the rows are read in, in one hand-over) or whose scales are
not finite is never used: the store is quantised again from the checkpoint and the file rewritten
atomically (moespec.fsutil). Wrong weights need a checkpoint rewritten with the same sizes, mtimes
and headers. The file is only a cache: when it cannot be written (a full disk, a read-only home)
the model runs without it and :meth:`QuantStoreCache.save` says why in one line.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moespec.artifacts import quant_store_path
from moespec.errors import OutputError
from moespec.integrity import DIGEST_KEY, new_hasher, tensor_header
from moespec.models.quant_layout import QuantLayout
from moespec.runtime.host.store import ExpertStore

FORMAT = 3  # bump when the row layout or the arithmetic changes (2: int4 packs halves; 3: groups along rows,
# int4 in blocks of 32: moespec.models.quant)
META_KEY = "moespec_quant_store"
TENSOR = "experts"


def checkpoint_fingerprint(folder: Path, files: list[Path]) -> list[list]:
    """[name, bytes, mtime_ns, sha256 of the header] of config.json and every safetensors shard."""
    out = []
    for path in [Path(folder) / "config.json", *files]:
        st = path.stat()
        with open(path, "rb") as fh:
            if path.suffix == ".safetensors":
                raw = fh.read(8)
                n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
                head = fh.read(min(n, 100_000_000))  # the header names every tensor; bounded if corrupt
            else:
                head = fh.read()
        out.append([path.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()])
    return out


def cache_path(model_folder: Path, layout: QuantLayout) -> Path:
    """Where the quantised store of ``model_folder`` with ``layout``'s settings lives."""
    return quant_store_path(model_folder, layout.bits, layout.group_size)


@dataclass(frozen=True)
class QuantStoreCache:
    """The cached quantised store of one model and one quantisation setting.

    Attributes:
        path: the cache file.
        meta: the header it must carry to be used (settings + checkpoint fingerprint).
    """

    path: Path
    meta: dict

    @classmethod
    def for_store(cls, model_folder: Path, fingerprint: Callable[[], list], store: ExpertStore) -> QuantStoreCache | None:
        """The cache for ``store`` (None when its layout is not quantised: nothing to cache); ``fingerprint``
        gives the checkpoint's (CheckpointSource.fingerprint, called only when there is something to cache)."""
        layout = store.layout
        if not isinstance(layout, QuantLayout):
            return None
        meta = {"format": FORMAT, "layout": type(layout).__name__, "bits": layout.bits,
                "group_size": layout.group_size, "hidden": layout.hidden, "intermediate": layout.intermediate,
                "row_bytes": layout.numel, "num_experts": store.num_experts, "moe_layers": store.moe_layers,
                "checkpoint": fingerprint()}
        return cls(cache_path(model_folder, layout), json.loads(json.dumps(meta)))

    def load_into(self, store: ExpertStore, overlap: bool = True) -> bool:
        """Fill ``store.buffer`` from the file, verified; False when it is absent, stale or damaged.

        :meth:`start_load` then its ``wait()``; ``overlap=False`` hashes and checks inline instead
        (one thread). Nothing partial is used: the caller quantises the whole store again when this
        returns False, and :meth:`save` replaces the file. :meth:`load_into_reference` is the slow check.
        """
        if overlap:
            pending = self.start_load(store)
            return pending is not None and pending.wait()
        read = self._read(store)
        return read is not None and PendingLoad(*read).wait()

    def start_load(self, store: ExpertStore) -> PendingLoad | None:
        """Read the rows into ``store.buffer`` and return while they are still being checked.

        The rows are read straight into the buffer (integrity.read_into, one copy), then the whole
        buffer goes to a second thread in one hand-over (integrity.BackgroundCheck, started before
        the read so that its start-up overlaps it): XXH3-128 (the file's digest) and NaN/Inf in the
        scales, overlapped with whatever the caller does until :meth:`PendingLoad.wait` (e.g. loading
        the dense weights). Only the scales can be NaN: the packed integer weights cannot. Returns
        None when the file is absent, stale or unreadable (nothing left running). The buffer must
        not be used, or freed, before ``wait()``.
        """
        from moespec.integrity import BackgroundCheck

        if not self.path.is_file():
            return None
        job = BackgroundCheck()  # started before the read: its start-up overlaps the read
        read = None
        try:
            read = self._read(store)
        finally:
            if read is None:
                job.cancel()
        return None if read is None else PendingLoad(*read, job=job)

    def _read(self, store: ExpertStore):
        """(the buffer's bytes, a hasher fed the tensor's header, the scales check, the digest
        wanted) once every row is read into ``store.buffer``; None when the file is absent, stale,
        unreadable or shorter than its header says."""
        from moespec.integrity import read_into

        if not self.path.is_file():
            return None
        buf = store.buffer  # [M, E, P] uint8, contiguous
        try:
            found = self._data_range(buf)
            if found is None:
                return None
            offset, want = found
            rows = buf.view(-1, buf.shape[-1]).numpy()  # [M * E, P]
            n = _scale_bytes(store.layout)
            with open(self.path, "rb", buffering=0) as fh:
                if not read_into(fh, offset, rows.reshape(-1)):
                    return None
        except Exception:  # a damaged header (bad JSON, wrong types), an unreadable file: rebuild
            return None
        hasher = new_hasher()
        tensor_header(hasher, TENSOR, buf.dtype, buf.shape)
        return rows.reshape(-1), hasher, lambda: _rows_finite(rows, n), want

    def _data_range(self, buf: torch.Tensor) -> tuple[int, str] | None:
        """(byte offset of the rows in the file, the digest its header records), or None when the
        header is not this cache's (settings, checkpoint, shape, dtype, size) or records no digest.

        Parsed here rather than by safetensors: the file is then read without a mapping.
        """
        with open(self.path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(fh.read(n))
        meta = json.loads(header.get("__metadata__", {}).get(META_KEY, "null"))
        want = meta.pop(DIGEST_KEY, None) if isinstance(meta, dict) else None
        info = header.get(TENSOR, {})
        start, stop = (int(v) for v in info.get("data_offsets", (0, -1)))
        if (meta != self.meta or info.get("dtype") != "U8" or tuple(info.get("shape", ())) != tuple(buf.shape)
                or stop - start != buf.numel() or self.path.stat().st_size != 8 + n + stop):
            return None
        if want is None:
            return None  # written before checksums: cannot be verified, so rebuilt once
        return 8 + n + start, want

    def load_into_reference(self, store: ExpertStore) -> bool:
        """:meth:`load_into` the slow, plain way (the test's reference): safetensors reads the whole
        tensor, then the digest of the whole buffer and torch.isfinite of every scale."""
        from safetensors import safe_open

        from moespec.integrity import tensors_digest

        if not self.path.is_file():
            return False
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as fh:
                meta = json.loads((fh.metadata() or {}).get(META_KEY, "null"))
                want = meta.pop(DIGEST_KEY, None) if isinstance(meta, dict) else None
                if meta != self.meta or want is None:
                    return False
                rows = fh.get_tensor(TENSOR)
            if rows.shape != store.buffer.shape or rows.dtype != torch.uint8:
                return False
            store.buffer.copy_(rows)
        except Exception:
            return False
        return tensors_digest({TENSOR: store.buffer}) == want and scales_finite_reference(store)

    def save(self, store: ExpertStore) -> str | None:
        """Write ``store.buffer`` atomically, with its data checksum.

        Returns:
            None when written; else one line saying why not (a full disk, an unwritable home), for the
            user: the file is only a cache, so nothing is raised and nothing partial stays.
        """
        from moespec.fsutil import check_free_space, save_safetensors_atomic

        tensors = {TENSOR: store.buffer}
        try:
            check_free_space(self.path, store.buffer.numel())  # before the write, not after
            save_safetensors_atomic(self.path, tensors, self.meta, META_KEY)
        except OutputError as exc:
            return f"the quantised experts are not cached ({exc.message}); the next start quantises them again"
        return None


class PendingLoad:
    """A quantised store read into its buffer whose check may still be running (QuantStoreCache.start_load).

    Args:
        data: the buffer's bytes; hasher: fed the tensor's header already; check: the scales check;
        want: the digest the file records; job: a started integrity.BackgroundCheck that is handed
        the work now (None: checked inline in :meth:`wait`).
    """

    def __init__(self, data, hasher, check, want: str, job=None) -> None:
        self._data, self._hasher, self._check, self._want = data, hasher, check, want
        self._thread = job
        if job is not None:
            job.submit(data, hasher, check)
        self._result: bool | None = None

    def wait(self) -> bool:
        """True when its digest matches the file's and every scale is finite; False otherwise
        (quantise again: the buffer holds damaged rows). Idempotent."""
        from moespec.integrity import check_bytes

        if self._result is None:
            try:
                ok = self._thread.wait() if self._thread is not None else check_bytes(self._data, self._hasher, self._check)
                self._result = ok and self._hasher.hexdigest() == self._want
            except Exception:
                self._result = False
        return self._result


def _scale_bytes(layout) -> int:
    """Bytes of float16 scales at the start of every row of ``layout`` (a QuantLayout)."""
    parts = layout.part_shapes()
    return parts["gate_up_scales"][0] + parts["down_scales"][0]


def _rows_finite(rows, n: int) -> bool:
    """True when the float16 scales in the first ``n`` bytes of every row of ``rows`` ([R, P] uint8
    numpy) are finite.

    A NaN scale would turn its whole group of weights into NaN; the checksum cannot catch one that
    was written (a checkpoint with NaN weights), so the rows are refused and quantised again. Tested
    on the bits: a float16 is NaN or infinite exactly when its exponent bits are all ones, i.e. its
    bit pattern is in 0x7C00..0x7FFF (positive) or 0xFC00..0xFFFF (negative). Read as int16 the
    positive ones are the largest values, read as uint16 the negative ones are: two max reductions
    over the scales in place, no temporary (tests/test_integrity_every_file.py compares this with
    torch.isfinite over every kind of bit pattern).
    """
    if not n or not len(rows):
        return True
    scales = rows[:, :n]  # [R, n] bytes: the scales lead every row
    return int(scales.view("<i2").max()) < 0x7C00 and int(scales.view("<u2").max()) < 0xFC00


def _scales_finite(store: ExpertStore) -> bool:
    """True when every row's float16 scales in ``store.buffer`` are finite (:func:`_rows_finite`)."""
    n = _scale_bytes(store.layout)
    return all(_rows_finite(store.buffer[m].numpy(), n) for m in range(store.buffer.shape[0]))


def scales_finite_reference(store: ExpertStore) -> bool:
    """:func:`_scales_finite` the slow, plain way (torch.isfinite on the float16 view): the test's reference."""
    n = _scale_bytes(store.layout)
    return bool(torch.isfinite(store.buffer[..., :n].view(torch.float16)).all())
