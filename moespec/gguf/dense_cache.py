"""The dense part of a GGUF model, dequantised once and kept beside its prepared folder.

Dequantising a GGUF's dense tensors costs seconds per GB of embeddings on a CPU; the second start
reads what the first computed instead. ``<prepared folder>/dense-<dtype>.safetensors`` holds every
dense tensor exactly as the source first yielded it (float32, or the compute dtype for large ones),
written while the first load streams (header first, then each tensor as it is made, so no second
copy of the dense part is ever held) into a temporary file renamed into place only when complete.
Its metadata names the format, the dtype and the GGUF's fingerprint; a file that differs in any of
them, or cannot be read, is ignored and rewritten. The prepared folder is replaced when the GGUF
changes, so a stale cache cannot outlive its file anyway.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

FORMAT = 1
META_KEY = "moespec_gguf_dense"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def cache_file(folder: Path, dtype: torch.dtype) -> Path:
    return Path(folder) / f"dense-{str(dtype).removeprefix('torch.')}.safetensors"


def _meta(dtype: torch.dtype, fingerprint: list) -> dict:
    return {"format": FORMAT, "dtype": str(dtype), "fingerprint": fingerprint}


def readable(path: Path, dtype: torch.dtype, fingerprint: list) -> bool:
    """True when ``path`` is a complete cache for ``dtype`` and this GGUF (header checked, no data read)."""
    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        meta = json.loads(header.get("__metadata__", {}).get(META_KEY, "null"))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error):
        return False
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return meta == json.loads(json.dumps(_meta(dtype, fingerprint))) and 8 + n + max(ends, default=0) == size


class DenseCacheWriter:
    """Writes tensors in a fixed order to a safetensors file whose header is known up front.

    Args:
        path: the cache file (written as ``path`` + ".tmp-PID", renamed by :meth:`finish`).
        specs: (name, dtype, shape) of every tensor, in the order :meth:`write` will get them.
        dtype, fingerprint: recorded in the metadata (what :func:`readable` checks).

    An OSError while writing disables the cache silently (loading never fails for it).
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], dtype: torch.dtype,
                 fingerprint: list) -> None:
        self.path, self.tmp = Path(path), Path(f"{path}.tmp-{os.getpid()}")
        header, at = {"__metadata__": {META_KEY: json.dumps(_meta(dtype, fingerprint), sort_keys=True)}}, 0
        self.order = []
        for name, dt, shape in specs:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [at, at + n]}
            self.order.append((name, dt, tuple(shape)))
            at += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._next = 0
        try:
            self._fh = open(self.tmp, "wb")
            self._fh.write(struct.pack("<Q", len(raw)) + raw)
        except OSError:
            self._fh = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor (must match the spec's name, dtype and shape, else the cache is dropped)."""
        if self._fh is None:
            return
        want = self.order[self._next] if self._next < len(self.order) else None
        if want != (name, tensor.dtype, tuple(tensor.shape)):
            self.abort()
            return
        try:
            self._fh.write(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        except OSError:
            self.abort()
            return
        self._next += 1

    def finish(self) -> None:
        """Rename into place when every tensor was written; otherwise drop the temporary file."""
        if self._fh is None:
            return
        complete = self._next == len(self.order)
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            if complete:
                os.replace(self.tmp, self.path)
        except OSError:
            pass
        self._fh = None
        self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.tmp.unlink(missing_ok=True)
