"""The dense part of a GGUF model, dequantised once and kept beside its prepared folder.

Dequantising a GGUF's dense tensors costs seconds per GB of embeddings on a CPU; the second start
reads what the first computed instead. ``<prepared folder>/dense-<dtype>.safetensors`` holds every
dense tensor exactly as the source first yielded it (float32, or the compute dtype for large ones),
written while the first load streams (header first, then each tensor as it is made, so no second
copy of the dense part is ever held) into an atomic write's locked temp folder (moespec.fsutil:
swept by the next write after a SIGKILL, and by ``moespec models --clean``), renamed into place
only when complete.

Its metadata names the format, the dtype, the GGUF's fingerprint and the XXH3-128 checksum of every
tensor (moespec.integrity: name, dtype, shape and bytes). The checksums are known only once the
data is written, so the header is written first with placeholders of the same length and
rewritten in place before the rename. A file is used only when its header is byte for byte the
one this moespec would write for these tensors (settings, names, shapes, offsets) and its size
matches; each tensor is then checked against its checksum as it is read, before it is handed on.
A damaged file (a flipped byte anywhere) is removed and the dense part dequantised again from the
GGUF (and cached anew); the tensors handed on before the damage showed are then handed on again.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

FORMAT = 2  # 2: a checksum of every tensor
META_KEY = "moespec_gguf_dense"
MAX_HEADER_BYTES = 100_000_000
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_PLACEHOLDER = "0" * 32  # as long as an XXH3-128 hex digest

Spec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one tensor


def cache_file(folder: Path, dtype: torch.dtype) -> Path:
    return Path(folder) / f"dense-{str(dtype).removeprefix('torch.')}.safetensors"


def _meta(dtype: torch.dtype, fingerprint: list) -> dict:
    return {"format": FORMAT, "dtype": str(dtype), "fingerprint": fingerprint}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def header_bytes(specs: list[Spec], meta: dict, digests: dict[str, str]) -> bytes:
    """The file's first bytes (8-byte length + JSON header, padded so the data is 8-byte aligned)
    for tensors ``specs`` in that order, with ``meta`` and the per-tensor ``digests`` (hex)."""
    header, at = {"__metadata__": {META_KEY: json.dumps({**meta, "digests": digests}, sort_keys=True)}}, 0
    for name, dt, shape in specs:
        n = _nbytes(dt, shape)
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def cached_digests(path: Path, specs: list[Spec], dtype: torch.dtype, fingerprint: list) -> dict[str, str] | None:
    """The per-tensor checksums of ``path`` when it is a complete cache of ``specs`` for ``dtype`` and
    this GGUF (its header exactly what :class:`DenseCacheWriter` writes, its size whole); else None.
    Reads the header only: the data is checked tensor by tensor as it is read (:func:`tensor_digest`)."""
    specs = [(name, dt, tuple(shape)) for name, dt, shape in specs]
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0]
            if n > MAX_HEADER_BYTES:
                return None
            raw = head + fh.read(n)
            size = path.stat().st_size
        digests = json.loads(json.loads(raw[8:])["__metadata__"][META_KEY])["digests"]
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    names = [name for name, _, _ in specs]
    if not isinstance(digests, dict) or sorted(digests) != sorted(names) \
            or not all(isinstance(v, str) and len(v) == len(_PLACEHOLDER) for v in digests.values()):
        return None
    want = header_bytes(specs, json.loads(json.dumps(_meta(dtype, fingerprint))), digests)
    data = sum(_nbytes(dt, shape) for _, dt, shape in specs)
    return digests if raw == want and size == len(want) + data else None


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """XXH3-128 of one tensor (moespec.integrity.tensors_digest: its name, dtype, shape and bytes)."""
    from moespec.integrity import tensors_digest

    return tensors_digest({name: tensor})


class DenseCacheWriter:
    """Writes tensors in a fixed order to a safetensors file whose header is known up front.

    Args:
        path: the cache file (written in a locked temp folder beside it, renamed by :meth:`finish`).
        specs: (name, dtype, shape) of every tensor, in the order :meth:`write` will get them.
        dtype, fingerprint: recorded in the metadata (what :func:`cached_digests` checks).

    The cache is only a cache: a folder that cannot be written, a disk that cannot hold the file
    (checked up front) or an OSError while writing drops it, with ``note`` saying why in one line;
    loading never fails for it.
    """

    def __init__(self, path: Path, specs: list[Spec], dtype: torch.dtype, fingerprint: list) -> None:
        from moespec.errors import OutputError
        from moespec.fsutil import AtomicFile

        self.path = Path(path)
        self.order = [(name, dt, tuple(shape)) for name, dt, shape in specs]
        self._meta, self.digests = _meta(dtype, fingerprint), {}
        self.note: str | None = None
        raw = header_bytes(self.order, self._meta, {name: _PLACEHOLDER for name, _, _ in self.order})
        self._next, self._file, self._fh = 0, None, None
        try:
            self._file = AtomicFile(self.path, size=len(raw) + sum(_nbytes(dt, s) for _, dt, s in self.order))
            self._fh = open(self._file.tmp, "wb")
            self._fh.write(raw)
        except OutputError as exc:
            self._drop(exc.message)
        except OSError as exc:
            self._drop(f"cannot write {self.path}: {exc.strerror or exc}")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor (must match the spec's name, dtype and shape, else the cache is dropped)."""
        if self._fh is None:
            return
        want = self.order[self._next] if self._next < len(self.order) else None
        if want != (name, tensor.dtype, tuple(tensor.shape)):
            self._drop(f"tensor {name} is not the one expected next")
            return
        data = tensor.detach().contiguous().cpu()
        try:
            if data.numel():
                self._fh.write(data.reshape(-1).view(torch.uint8).numpy())
        except OSError as exc:
            self._drop(f"cannot write {self.path}: {exc.strerror or exc}")
            return
        self.digests[name] = tensor_digest(name, data)
        self._next += 1

    def finish(self) -> None:
        """Write the checksums into the header and rename into place when every tensor was written;
        otherwise drop the temporary file."""
        from moespec.errors import OutputError

        if self._fh is None:
            return
        if self._next != len(self.order):
            self._drop("loading stopped before every dense tensor was written")
            return
        raw = header_bytes(self.order, self._meta, self.digests)
        try:
            self._fh.seek(0)
            self._fh.write(raw)  # the same length as the placeholders' header
            self._fh.close()
            self._fh = None
            self._file.commit()
            self._file = None
        except OutputError as exc:
            self._drop(exc.message)
        except OSError as exc:
            self._drop(f"cannot write {self.path}: {exc.strerror or exc}")

    def abort(self) -> None:
        """Drop the temporary file (a no-op once finished)."""
        self._drop(None)

    def _drop(self, why: str | None) -> None:
        if why is not None and self.note is None:
            self.note = f"the dense weights are not cached ({why}); the next start dequantises them again"
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._file is not None:
            self._file.discard()
            self._file = None
