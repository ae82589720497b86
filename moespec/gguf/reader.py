"""GgufCheckpoint: a GGUF model's metadata and tensor table, and its tensor bytes read on demand.

Each file's header is parsed (all parts of a split set; ``_parse``); the table keeps, per tensor,
its type, its shape in torch order (ggml lists dimensions fastest first), which part holds it, its
absolute byte offset and its size. Bytes are then read with plain file reads into the caller's
buffer (an expert row of the store, a scratch buffer), never through a mapping: a mapping keeps
every page read resident for as long as it lives (counted in the process's RSS), a read puts the
bytes where they belong once. So loading holds what it keeps and one tensor at most.

The table round-trips through JSON (``to_json`` / ``from_json``) with each part's fingerprint, so
a second start reads neither the metadata nor the tokenizer arrays again.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from moespec.errors import CheckpointError
from moespec.gguf.dequant import tensor_bytes
from moespec.gguf.files import GgufFiles

# Metadata arrays longer than this (vocabularies, merges, token types) are not copied: transformers
# reads the tokenizer from the file itself; the length is kept (e.g. the vocabulary size).
_MAX_ARRAY = 256


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    Attributes:
        name: its GGUF name ("blk.0.ffn_gate_exps.weight").
        ggml_type: its GGMLQuantizationType id.
        shape: torch order ([E, I, H] for ffn_gate_exps; blocks run along the last dimension).
        part: index of the split part holding it.
        offset: absolute byte offset of its data in that part.
        nbytes: bytes of its data.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    part: int
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along the first dimension (one expert of an [E, ...] tensor)."""
        return self.nbytes // self.shape[0] if self.shape else self.nbytes


def fingerprint(path: Path, header_bytes: int) -> list:
    """[name, bytes, mtime_ns, sha256 of the header] of one part: what a cached table is checked against."""
    st = path.stat()
    with open(path, "rb") as fh:
        head = fh.read(header_bytes)
    return [path.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()]


class GgufCheckpoint:
    """Metadata + tensor table of one GGUF model (all split parts).

    Args:
        files: the model's parts.
        metadata: key -> value of part 1 (long arrays as {"array_length": n}).
        tensors: GGUF name -> TensorInfo, over every part.
        header_bytes: per part, the bytes before its tensor data (what the fingerprint hashes).
    """

    def __init__(self, files: GgufFiles, metadata: dict, tensors: dict[str, TensorInfo], header_bytes: list[int]):
        self.files, self.metadata, self.tensors, self.header_bytes = files, metadata, tensors, header_bytes

    @classmethod
    def open(cls, files: GgufFiles) -> GgufCheckpoint:
        """Parse every part's header.

        Raises:
            CheckpointError: not a GGUF file, truncated (a tensor ends past the end of its file), a
                tensor type gguf does not know, a split part that says another split count.
        """
        metadata, tensors, header = {}, {}, []
        for i, path in enumerate(files.parts):
            fields, table, data_start = _parse(path)
            if i == 0:
                metadata = fields
            count = fields.get("split.count")
            if count is not None and int(count) != len(files.parts):
                raise CheckpointError(f"{path.name} says its model has {count} split parts, found {len(files.parts)}",
                                      "keep every part of one download together")
            size = path.stat().st_size
            for t in table:
                if t.offset + t.nbytes > size:
                    raise CheckpointError(f"{path} is truncated: tensor {t.name} ends at byte {t.offset + t.nbytes}, "
                                          f"the file has {size}", "download the file again")
                tensors[t.name] = TensorInfo(t.name, t.ggml_type, t.shape, i, t.offset, t.nbytes)
            header.append(data_start)
        return cls(files, metadata, tensors, header)

    # --- metadata ----------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        """general.architecture as llama.cpp names it ("qwen3moe", "gpt-oss", "llama", ...)."""
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """``{arch}.key`` for keys starting with ".", else the key as given; ``default`` when absent."""
        return self.metadata.get(f"{self.arch}{key}" if key.startswith(".") else key, default)

    # --- tensor bytes ------------------------------------------------------------------------
    def read(self, info: TensorInfo, start: int = 0, count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``[start, start + count)`` of ``info``'s data (default: all), into ``out`` if given.

        Returns:
            uint8 [count] on the CPU (``out`` itself when given: any contiguous uint8 CPU tensor of that size).

        Raises:
            CheckpointError: the file ended early (it changed since its header was read).
        """
        count = info.nbytes - start if count is None else count
        buf = torch.empty(count, dtype=torch.uint8) if out is None else out
        view = memoryview(buf.numpy()).cast("B")
        path = self.files.parts[info.part]
        with open(path, "rb", buffering=0) as fh:
            fh.seek(info.offset + start)
            got = 0
            while got < count:
                n = fh.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{path} ended while reading tensor {info.name}",
                                          "the file is truncated or changed while loading: download it again")
                got += n
        return buf

    def fingerprints(self) -> list[list]:
        """Every part's fingerprint (see :func:`fingerprint`)."""
        return [fingerprint(p, n) for p, n in zip(self.files.parts, self.header_bytes)]

    # --- cache -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"parts": [str(p) for p in self.files.parts], "quant": self.files.quant, "metadata": self.metadata,
                "header_bytes": self.header_bytes, "tensors": [asdict(t) for t in self.tensors.values()]}

    @classmethod
    def from_json(cls, data: dict) -> GgufCheckpoint:
        files = GgufFiles(tuple(Path(p) for p in data["parts"]), data.get("quant", ""))
        tensors = {t["name"]: TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"]}
        return cls(files, data["metadata"], tensors, list(data["header_bytes"]))


@dataclass(frozen=True)
class _Entry:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# GGUF metadata value types (gguf.GGUFValueType) of fixed size -> struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _parse(path: Path) -> tuple[dict, list[_Entry], int]:
    """(metadata, tensor entries, data start) of one file, reading only its header.

    Why not gguf's GGUFReader: it builds a numpy array per element of every metadata array, ~25 s
    for a 151936-token vocabulary on this project's machine (this walk: ~0.3 s); the vocabulary
    is read by transformers' tokenizer reader instead. Long arrays are walked, not kept.

    Raises:
        CheckpointError: see :meth:`GgufCheckpoint.open`.
    """
    import struct

    size = path.stat().st_size
    try:
        blob = np.memmap(path, mode="r", dtype=np.uint8) if size else b""
        if bytes(blob[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian or very old file)")
        pos, fields = 24, {}
        for _ in range(kv_count):
            key, pos = _string(blob, pos)
            (kind,) = struct.unpack_from("<I", blob, pos)
            fields[key], pos = _value(blob, pos + 4, kind)
        table = []
        for _ in range(count):
            name, pos = _string(blob, pos)
            (ndim,) = struct.unpack_from("<I", blob, pos)
            dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            table.append((name, ggml_type, tuple(int(d) for d in reversed(dims)), offset))
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file ({exc}; the file is {size} bytes)",
                              "the file is truncated or corrupt: download it again") from None
    align = int(fields.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    entries = [_Entry(n, t, shape, data_start + off, tensor_bytes(t, shape)) for n, t, shape, off in table]
    return fields, entries, data_start


def _string(blob, pos: int) -> tuple[str, int]:
    import struct

    (n,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + n
    if end > len(blob):
        raise ValueError("a string runs past the end of the file")
    return bytes(blob[pos + 8 : end]).decode("utf-8"), end


def _value(blob, pos: int, kind: int):
    """One metadata value and the position after it; arrays longer than _MAX_ARRAY become their length."""
    import struct

    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"metadata value type {kind}")
    elem, n = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if elem in _SCALARS:
        width = struct.calcsize(_SCALARS[elem])
        if n > _MAX_ARRAY:
            return {"array_length": n}, pos + width * n
        return list(struct.unpack_from(f"<{n}{_SCALARS[elem][1]}", blob, pos)), pos + width * n
    values = []
    for _ in range(n):
        value, pos = _value(blob, pos, elem)
        if n <= _MAX_ARRAY:
            values.append(value)
    return (values if n <= _MAX_ARRAY else {"array_length": n}), pos
