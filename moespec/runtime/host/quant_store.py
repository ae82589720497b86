"""QuantStoreCache: the quantised expert store kept on disk, so the second start does not quantise again.

Shapes: M MoE layers, E experts, P bytes per packed expert row (QuantLayout.numel).

File: ``<moespec home>/experts/<model id>/int4-g64.safetensors`` (moespec.artifacts.quant_store_path), one tensor ``experts`` [M, E, P] uint8 - the store's buffer as is - and a JSON header entry
``moespec_quant_store`` with the settings (format version, bits, group size, H, I, E, MoE layers)
and the checkpoint's fingerprint: for config.json and every shard, its name, size, mtime and the
sha256 of the safetensors header (tensor names, dtypes, shapes, offsets). Reading the header costs
a few kB per shard, never the weights.

A file whose header differs in anything (checkpoint changed, other settings, older format), that
cannot be read (truncated), whose data does not match the XXH3-128 checksum in its header (a flipped
byte; moespec.integrity, checked block by block while the rows are copied in) or whose scales are
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
from moespec.integrity import DIGEST_KEY, new_hasher, tensor_header, update
from moespec.models.quant_layout import QuantLayout
from moespec.runtime.host.checkpoint import WINDOW_BYTES, MappingWindow
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

    def load_into(self, store: ExpertStore) -> bool:
        """Fill ``store.buffer`` from the file, block by block; False when it is absent or stale.

        A stale or unreadable file is left for :meth:`save` to replace; nothing partial is used (the
        caller quantises the whole store again when this returns False).
        """
        if not self.path.is_file():
            return False
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as fh:
                meta = json.loads((fh.metadata() or {}).get(META_KEY, "null"))
                want = meta.pop(DIGEST_KEY, None) if isinstance(meta, dict) else None
                rows = fh.get_slice(TENSOR)
                shape, dtype = tuple(rows.get_shape()), rows.get_dtype()
                if meta != self.meta or shape != tuple(store.buffer.shape) or dtype != "U8":
                    return False
            if want is None:
                return False  # written before checksums: cannot be verified, so rebuilt once
            # Blocks of rows through a reopened mapping: a mapping keeps each page read resident
            # (checkpoint.iter_tensors), so the whole file is never resident beside the store.
            buf = store.buffer  # [M, E, P]
            hasher = new_hasher()
            tensor_header(hasher, TENSOR, buf.dtype, buf.shape)
            step = max(1, WINDOW_BYTES // buf.shape[2])  # rows per window
            with MappingWindow(self.path) as window:
                for m in range(buf.shape[0]):
                    for e in range(0, buf.shape[1], step):
                        block = buf[m, e : e + step]  # [<=step, P]
                        block.copy_(window.handle().get_slice(TENSOR)[m, e : e + block.shape[0]])
                        update(hasher, block)  # rows in file order: the digest of the whole tensor
                        window.count(block.numel())
        except Exception:  # safetensors raises its own errors for truncated/corrupt files: rebuild
            return False
        return hasher.hexdigest() == want and _scales_finite(store)

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


def _scales_finite(store: ExpertStore) -> bool:
    """True when every row's float16 scales (the first bytes of a QuantLayout row) are finite.

    A NaN scale would turn its whole group of weights into NaN; the checksum cannot catch one that
    was written (a checkpoint with NaN weights), so the rows are refused and quantised again. Tested
    on the bits: a float16 is NaN or infinite exactly when its exponent bits are all ones, i.e. its
    bits without the sign are >= 0x7C00 (one integer max per layer, ~10x cheaper than torch's
    float16 isfinite here; tests/test_integrity.py compares the two).
    """
    parts = store.layout.part_shapes()
    n = parts["gate_up_scales"][0] + parts["down_scales"][0]  # bytes: scales first in every row
    for m in range(store.buffer.shape[0]):
        bits = store.buffer[m].numpy()[:, :n].view("<u2")  # [E, n / 2] float16 bit patterns
        if bits.size and int((bits & 0x7FFF).max()) >= 0x7C00:
            return False
    return True


def scales_finite_reference(store: ExpertStore) -> bool:
    """:func:`_scales_finite` the slow, plain way (torch.isfinite on the float16 view): the test's reference."""
    parts = store.layout.part_shapes()
    n = parts["gate_up_scales"][0] + parts["down_scales"][0]
    return bool(torch.isfinite(store.buffer[..., :n].view(torch.float16)).all())
