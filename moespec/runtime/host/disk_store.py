"""DiskStore: the expert rows kept in moespec's own file on disk, read row by row with O_DIRECT (the disk tier).

Shapes: M MoE layers, E experts, P storage elements per packed row (ExpertLayout.numel), R = P x itemsize
bytes of data per row, and a row stride of R rounded up to ALIGN (4096) bytes.

File: ``<moespec home>/experts/<model id>/rows-<format>.moerows`` (keyed like the quantised store,
quant_store.py: one file per model and expert format), written once at the first load, atomically
(fsutil.atomic_path: a full disk is a one-line error and leaves nothing). Layout:

- bytes [0, data_offset): MAGIC, the header length (u64 little-endian), a JSON header: the settings
  (format version, layout, dtype, M, E, P, the stride) and the checkpoint's fingerprint
  (quant_store.checkpoint_fingerprint: names, sizes, mtimes, header hashes), then every row's
  XXH3-128 checksum (moespec.integrity); zero-padded to a multiple of ALIGN.
- row (m, e) at ``data_offset + (m * E + e) * stride``: R bytes of data, zero-padded to the stride.

Every offset and length is a multiple of ALIGN, so a row is one O_DIRECT read straight into a RAM
slot (:meth:`DiskStore.slot_rows` makes slots with the same stride, page-aligned) and bypasses the
page cache. A file whose header differs (other checkpoint, other settings), that is shorter or longer
than its header says (truncated), or whose header does not parse is rebuilt from the checkpoint; a
row whose checksum does not match when it is read (the file changed under a running model) is an
error for that request (runtime.transfer.disk) and the file is removed, so the next start rebuilds it.
Never wrong weights.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moespec.artifacts import model_key, sanitize_model_id
from moespec.config import OnMiss
from moespec.errors import OptionError
from moespec.integrity import new_hasher
from moespec.models.base import ExpertLayout
from moespec.paths import moespec_home
from moespec.runtime.host import hugepages
from moespec.runtime.host.store import ExpertStore

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the logical block (<= 4096 here)
FORMAT = 1
MAGIC = b"MOESPEC-ROWS\x00\x00\x00\x01"  # 16 bytes


def round_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def store_path(model_folder: Path, format_name: str) -> Path:
    """Where the disk store of ``model_folder`` in expert format ``format_name`` (e.g. bf16, int4-g64) lives."""
    return moespec_home() / "experts" / sanitize_model_id(model_key(model_folder)) / f"rows-{format_name}.moerows"


@dataclass(frozen=True)
class DiskRow:
    """Where one packed row lies in the store file (what ExpertStore.expert is for the host store).

    Attributes:
        key: (decoder layer, expert).
        offset: byte offset in the file (a multiple of ALIGN).
        nbytes: bytes of data (the layer's row).
        length: bytes one O_DIRECT read takes: ``nbytes`` rounded up to ALIGN (into the slot's padding).
        digest: its XXH3-128 hex checksum.
    """

    key: tuple[int, int]
    offset: int
    nbytes: int
    length: int
    digest: str

    def __getitem__(self, part: slice) -> DiskRow:
        """The row's first ``part.stop`` elements: the cache asks for the layer's row, which is this one."""
        return self


class DiskStore:
    """The packed experts of one model in a file, read one row at a time (module docstring).

    It stands where an ExpertStore stands for the cache (same attributes: moe_layers, position,
    num_experts, layout, dtype, expert_bytes, row_numel, copy_bytes, total_bytes), but ``expert``
    gives a DiskRow for the disk reader (runtime.transfer.disk.DiskReadEngine), not a tensor.

    Raises (open): nothing; :meth:`open` returns None for a file that must be rebuilt.
    """

    def __init__(self, path: Path, header: dict, data_offset: int) -> None:
        self.path = Path(path)
        self.header = header
        self.data_offset = data_offset
        self.moe_layers = list(header["moe_layers"])
        self.position = {layer: m for m, layer in enumerate(self.moe_layers)}
        self.num_experts = int(header["num_experts"])
        self.stride = int(header["stride"])
        self.digests: list[str] = header["digests"]
        self.layout: ExpertLayout = None  # type: ignore[assignment]  # set by the loader (the source's layout)
        self.dtype: torch.dtype = None  # type: ignore[assignment]
        self.pinned = False
        self._slot_maps: list[mmap.mmap] = []

    # --- what the cache asks of a store ---------------------------------------------------------
    def bind(self, layout: ExpertLayout, dtype: torch.dtype) -> DiskStore:
        """Attach the layout and model dtype the rows were written with (checked against the header)."""
        self.layout, self.dtype = layout, layout.storage_dtype(dtype)
        assert int(self.header["numel"]) == layout.numel and self.header["dtype"] == str(self.dtype)
        return self

    @property
    def expert_bytes(self) -> int:
        """Bytes of one packed expert (R)."""
        return self.layout.numel * self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per storage element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def row_numel(self, layer: int) -> int:
        """Storage elements of layer ``layer``'s rows that hold data (ExpertStore.row_numel)."""
        return self.layout.for_layer(layer).numel

    def copy_bytes(self, layer: int) -> int:
        """Bytes one read of a layer-``layer`` row delivers."""
        return self.row_numel(layer) * self.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of expert data in the file (without padding)."""
        return len(self.moe_layers) * self.num_experts * self.expert_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes the file takes on disk (header + padded rows)."""
        return self.data_offset + len(self.moe_layers) * self.num_experts * self.stride

    def expert(self, layer: int, expert: int) -> DiskRow:
        """Where row (``layer``, ``expert``) lies."""
        i = self.position[layer] * self.num_experts + expert
        n = self.copy_bytes(layer)
        return DiskRow((layer, expert), self.data_offset + i * self.stride, n, round_up(n), self.digests[i])

    def slot_rows(self, num_slots: int, device: torch.device) -> torch.Tensor:
        """RAM slots [S, P] for rows read with O_DIRECT: page-aligned, one stride apart (the padding
        takes the read's round-up to ALIGN)."""
        assert device.type == "cpu", "the disk tier reads into host RAM"
        raw = mmap.mmap(-1, max(num_slots * self.stride, 1), flags=hugepages.PRIVATE)  # page-aligned, zero on first touch
        # 2 MB pages: the CPU kernels stream experts from the slots (host/hugepages.py), and O_DIRECT
        # into them ran 1.7-1.9x the GB/s of 4 KB pages (docs/decisions.md, 2026-12-03)
        if hugepages.enabled():
            try:
                raw.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP off: 4 KB pages
        self._slot_maps.append(raw)
        buf = torch.frombuffer(raw, dtype=torch.uint8, count=num_slots * self.stride) if num_slots else \
            torch.empty(0, dtype=torch.uint8)
        return buf.view(num_slots, self.stride)[:, : self.expert_bytes].view(self.dtype)  # [S, P]

    def mapped(self) -> ExpertStore:
        """The rows as an ExpertStore over a read-only mapping of the file: the mmap baseline (the OS page
        cache as the expert cache, a page fault per page on first touch, as llama.cpp reads its GGUF);
        copies from it go through the plain copy engine, no O_DIRECT, no prediction of its own."""
        import warnings

        fd = os.open(self.path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: nothing writes the rows
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mm, dtype=torch.uint8)
        rows = raw[self.data_offset :].view(len(self.moe_layers), self.num_experts, self.stride)
        rows = rows[:, :, : self.expert_bytes].view(self.dtype)  # [M, E, P]
        store = ExpertStore(self.moe_layers, self.num_experts, self.layout, self.dtype, buffer=rows)
        store.mapping = mm  # why: the rows view the mapping; it lives as long as the store
        store.file = self.path  # whose page cache a profiled run drops first (host/page_cache.py)
        return store

    def close(self) -> None:
        """Nothing to unpin (the reader closes its file)."""

    def forget(self) -> None:
        """Remove the file (a row failed its checksum): the next start rebuilds it."""
        try:
            self.path.unlink()
        except OSError:
            pass

    # --- the file ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path, meta: dict) -> DiskStore | None:
        """The store in ``path`` when its header carries ``meta`` and its size is whole; else None (rebuild)."""
        try:
            with open(path, "rb") as fh:
                head = fh.read(ALIGN)
                if len(head) < 24 or head[:16] != MAGIC:
                    return None
                n = struct.unpack("<Q", head[16:24])[0]
                if n > 1 << 30:
                    return None
                fh.seek(24)
                header = json.loads(fh.read(n))
            size = os.stat(path).st_size
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict) or header.get("meta") != meta or header.get("format") != FORMAT:
            return None
        data_offset = round_up(24 + n)
        rows = len(header.get("moe_layers", [])) * int(header.get("num_experts", 0))
        if size != data_offset + rows * int(header.get("stride", 0)) or len(header.get("digests", [])) != rows:
            return None
        return cls(path, header, data_offset)

    @staticmethod
    def header_for(meta: dict, moe_layers: list[int], num_experts: int, layout: ExpertLayout,
                   dtype: torch.dtype) -> dict:
        """The header (without digests) of a store of these settings."""
        store_dtype = layout.storage_dtype(dtype)
        itemsize = torch.empty((), dtype=store_dtype).element_size()
        return {"format": FORMAT, "meta": meta, "moe_layers": list(moe_layers), "num_experts": num_experts,
                "numel": layout.numel, "dtype": str(store_dtype), "stride": round_up(layout.numel * itemsize)}

    @classmethod
    def write(cls, path: Path, header: dict, layout: ExpertLayout, dtype: torch.dtype,
              fill: Callable[[ExpertStore], None]) -> DiskStore:
        """Write the store file once: ``fill`` writes every row into an ExpertStore over the file's mapping
        (the loader reads the checkpoint into it), then the checksums and the header go in and the file
        is renamed into place.

        Raises:
            OutputError: the disk is full or the folder unwritable (one line; no partial file stays).
            CheckpointError: from ``fill`` (a missing expert tensor, ...); nothing stays either.
        """
        from moespec.fsutil import atomic_path

        moe_layers, num_experts, stride = header["moe_layers"], header["num_experts"], header["stride"]
        rows = len(moe_layers) * num_experts
        digest_chars = rows * 36  # "<32 hex>", per row
        data_offset = round_up(24 + len(json.dumps(header)) + 64 + digest_chars)
        size = data_offset + rows * stride
        with atomic_path(path, size=size) as tmp:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)  # why: a full disk fails here, not half-way through the rows
                with mmap.mmap(fd, size) as mm:
                    raw = torch.frombuffer(mm, dtype=torch.uint8, count=size)
                    store_dtype = layout.storage_dtype(dtype)
                    buf = raw[data_offset:].view(len(moe_layers), num_experts, stride)
                    rows_view = buf[:, :, : layout.numel * torch.empty((), dtype=store_dtype).element_size()]
                    store = ExpertStore(moe_layers, num_experts, layout, dtype, buffer=rows_view.view(store_dtype))
                    fill(store)
                    digests = [_row_digest(store.buffer[m, e, : layout.for_layer(layer).numel])
                               for m, layer in enumerate(moe_layers) for e in range(num_experts)]
                    text = json.dumps({**header, "digests": digests}).encode()
                    assert 24 + len(text) <= data_offset, "header estimate too small"
                    # Padded with spaces (JSON allows them) to the rows: open() finds them at round_up(24 + n).
                    text = text.ljust(data_offset - 24)
                    raw[:16].copy_(torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8))
                    raw[16:24].copy_(torch.frombuffer(bytearray(struct.pack("<Q", len(text))), dtype=torch.uint8))
                    raw[24 : 24 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
                    del raw, buf, rows_view, store
                    mm.flush()
                os.fsync(fd)
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # the rows are read with O_DIRECT
            finally:
                os.close(fd)
        got = cls.open(path, header["meta"])
        assert got is not None, f"{path} unreadable right after writing it"
        return got


def _row_digest(row: torch.Tensor) -> str:
    """XXH3-128 hex checksum of one row's data bytes (moespec.integrity's hasher)."""
    h = new_hasher()
    h.update(row.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def check_on_miss(on_miss: OnMiss) -> None:
    """The one rule for every command and every policy switch: experts on disk are fetched.

    Raises:
        OptionError: --on-miss other than fetch (a host-computed miss needs its row in RAM already).
    """
    if on_miss != OnMiss.FETCH:
        raise OptionError(f"--on-miss {on_miss.value} cannot run with the experts on disk",
                          "use --on-miss fetch (the default) with --host-memory")
