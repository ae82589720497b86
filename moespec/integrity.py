"""Is a file moespec wrote still what it wrote? Data checksums, finiteness, truncation.

Every safetensors file moespec writes for itself (calibration, estimators, the quantised expert
store, estimator states, default-model build checkpoints) carries in its header a checksum of its
tensor DATA, not only of the header: xxHash's XXH3-128 over each tensor's name, dtype, shape and
bytes in name order (fast and non-cryptographic: a damaged file, not a forged one). A large file
(the quantised expert store) is read with :func:`read_into`, then :class:`BackgroundCheck` hashes
and checks the whole buffer on a second thread while the caller loads something else (the dense
weights), so the load waits for little more than the read itself (scripts/integrity_cost.py;
README, "Files and faults"). A file without a checksum (written before it existed) is read as before.

On a mismatch a cache is rebuilt and a user's file refused with one line; a tensor that must be
finite and is not (NaN/Inf) is refused the same way, since a NaN default vector or estimator weight
would silently wreck every prediction.
"""

from __future__ import annotations

import json
import math
import os
import _thread
import struct
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

# Where the checksum goes: a field of the file's moespec JSON metadata entry (one entry, because
# safetensors writes several metadata keys in hash order, which would make equal files differ in
# bytes), or a metadata key of its own in files that have no other.
DIGEST_KEY = "moespec_xxh3_128"


def new_hasher():
    """A streaming XXH3-128 hasher (``update(bytes-like)``, ``hexdigest()``)."""
    import xxhash

    return xxhash.xxh3_128()


def _raw(tensor):
    """The bytes of a contiguous CPU tensor as a numpy uint8 view (no copy)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(__import__("torch").uint8).numpy()


def tensor_header(hasher, name: str, dtype, shape) -> None:
    """Feed what identifies one tensor (name, dtype, shape) to ``hasher``; its bytes follow, in order."""
    hasher.update(f"{name}\0{dtype}\0{tuple(shape)}\0".encode())


def update(hasher, tensor) -> None:
    """Feed ``tensor``'s bytes (C order) to ``hasher``."""
    if tensor.numel():
        hasher.update(_raw(tensor))


def tensors_digest(tensors: Mapping[str, object]) -> str:
    """XXH3-128 hex digest of ``tensors`` (name -> torch tensor): names, dtypes, shapes and data, in name order.

    Equal to a stream of :func:`tensor_header` + :func:`update` calls over the same tensors in name
    order, so a reader that copies a tensor block by block can check it on the way.
    """
    h = new_hasher()
    for name in sorted(tensors):
        t = tensors[name]
        tensor_header(h, name, t.dtype, t.shape)
        update(h, t)
    return h.hexdigest()


def digest_metadata(tensors: Mapping[str, object]) -> dict[str, str]:
    """The metadata of a file with no other entry: ``{DIGEST_KEY: digest}``."""
    return {DIGEST_KEY: tensors_digest(tensors)}


def with_digest(meta: dict, tensors: Mapping[str, object]) -> dict:
    """``meta`` (a file's JSON metadata) with the checksum of ``tensors`` added as field DIGEST_KEY."""
    return {**meta, DIGEST_KEY: tensors_digest(tensors)}


def verify_digest(metadata: Mapping | None, tensors: Mapping[str, object]) -> bool | None:
    """True when the checksum in ``metadata`` (field or key DIGEST_KEY) matches ``tensors``, False when it
    does not, None when there is none."""
    want = (metadata or {}).get(DIGEST_KEY)
    if want is None:
        return None
    return tensors_digest(tensors) == want


def nonfinite(tensors: Mapping[str, object], names: Iterable[str] | None = None, allow_nan: bool = False) -> list[str]:
    """Names of the floating-point tensors among ``names`` (default: all) holding Inf, or NaN unless ``allow_nan``."""
    import torch

    bad = []
    for name in sorted(tensors if names is None else names):
        t = tensors[name]
        if not t.is_floating_point() or not t.numel():
            continue
        wrong = torch.isinf(t) if allow_nan else ~torch.isfinite(t)
        if bool(wrong.any()):
            bad.append(name)
    return bad


MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers


def safetensors_damage(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file ("truncated: 1,024 of 2,219,616 bytes"), or None.

    Reads only the 8-byte header length and the JSON header: a file shorter than its header says
    is truncated; one whose header does not parse is corrupt.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return f"truncated: {size:,} bytes, not even a safetensors header"
            n = struct.unpack("<Q", raw)[0]
            if n > MAX_HEADER_BYTES or (size > 8 and fh.read(1) != b"{"):
                return "corrupt: not a safetensors file"
            fh.seek(8)
            if 8 + n > size:
                return f"truncated: {size:,} bytes, shorter than its {n:,}-byte header"
            header = json.loads(fh.read(n))
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    except ValueError:
        return "corrupt: its header is not valid JSON"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, ValueError, IndexError):
        return "corrupt: its header has no valid tensor offsets"
    if 8 + n + end > size:
        return f"truncated: {size:,} of {8 + n + end:,} bytes"
    return None


def finite_or_none(value: float) -> float | None:
    """``value``, or None where it is NaN or infinite (JSON has no NaN)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def json_safe(obj):
    """``obj`` with every NaN/Inf float replaced by None, recursively (dicts, lists, tuples)."""
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# The checksum field of a JSON file moespec writes and reads back (eval per-arm results, the
# estimator-states manifest, the default build's marker and state.json).
JSON_DIGEST_KEY = "xxh3"


def json_digest(obj: Mapping) -> str:
    """XXH3-128 hex digest of ``obj``'s canonical JSON, without its ``JSON_DIGEST_KEY`` field.

    Canonical: sorted keys, no spaces, ASCII, NaN/Infinity as Python's json writes them, so a
    parsed-back object gives the digest it was written with (floats round-trip exactly).
    """
    rest = {k: v for k, v in obj.items() if k != JSON_DIGEST_KEY}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    h = new_hasher()
    h.update(text.encode("ascii"))
    return h.hexdigest()


def seal_json(obj: Mapping) -> dict:
    """``obj`` (a JSON object) with its checksum field set: write this, read it with :func:`open_json`."""
    return {**{k: v for k, v in obj.items() if k != JSON_DIGEST_KEY}, JSON_DIGEST_KEY: json_digest(obj)}


def open_json(obj) -> tuple[object, bool | None]:
    """(``obj`` without its checksum field, verdict): True when the field matches the rest, False
    when it does not (a damaged file: treat it like a truncated one), None when ``obj`` has no field
    (a file written before it existed, or not a JSON object: accepted as before)."""
    if not isinstance(obj, dict) or JSON_DIGEST_KEY not in obj:
        return obj, None
    rest = {k: v for k, v in obj.items() if k != JSON_DIGEST_KEY}
    return rest, obj[JSON_DIGEST_KEY] == json_digest(rest)


def per_tensor_digests(tensors: Mapping[str, object]) -> dict[str, str]:
    """{DIGEST_KEY: JSON of name -> digest of that tensor alone}: for files read a few tensors at a time."""
    return {DIGEST_KEY: json.dumps({name: tensors_digest({name: t}) for name, t in sorted(tensors.items())})}


def mismatched(metadata: Mapping[str, str] | None, tensors: Mapping[str, object]) -> list[str] | None:
    """Names among ``tensors`` whose data differs from the per-tensor checksums in ``metadata``
    (:func:`per_tensor_digests`); None when the file has none."""
    raw = (metadata or {}).get(DIGEST_KEY)
    if raw is None:
        return None
    want = json.loads(raw)
    return [name for name, t in sorted(tensors.items()) if want.get(name) != tensors_digest({name: t})]


def file_digest(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """XXH3-128 hex digest of a whole file's bytes, read in chunks."""
    h = new_hasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def read_into(fh, offset: int, dest) -> bool:
    """Read ``len(dest)`` bytes of the open file ``fh`` from byte ``offset`` straight into ``dest``.

    ``readinto`` (one copy, no mapping), looping on short reads; the kernel is told the read is
    sequential (read-ahead for a cold read from disk).

    Args:
        fh: a binary file opened unbuffered (``open(path, "rb", buffering=0)``).
        dest: a writable contiguous buffer (e.g. a store's buffer viewed flat as uint8 numpy).

    Returns:
        False when the file ended first (``dest`` then holds a partial read: do not use it).

    Raises:
        OSError: reading failed.
    """
    view = memoryview(dest).cast("B")
    try:
        os.posix_fadvise(fh.fileno(), offset, len(view), os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError):
        pass
    fh.seek(offset)
    done = 0
    while done < len(view):
        n = fh.readinto(view[done:])
        if not n:
            return False
        done += n
    return True


def check_bytes(data, hasher, check: Callable[[], bool] | None = None) -> bool:
    """Feed all of ``data`` (bytes-like) to ``hasher`` in one call, then run ``check()`` (e.g. "are
    the scales finite"): False when ``check`` refuses. The caller compares ``hasher``'s digest.
    ``hasher`` may be None (only ``check``). :class:`BackgroundCheck` runs this on a second thread."""
    if hasher is not None:
        hasher.update(data)
    return check is None or bool(check())


class BackgroundCheck:
    """:func:`check_bytes` on a second thread: the whole buffer in one hand-over.

    The thread starts at construction and waits for :meth:`submit` (or :meth:`cancel`), so a caller
    can start it before its read and the thread's start-up (~0.2 ms on this VM) overlaps the read
    instead of following it. python-xxhash (>= 3) hashes without the GIL for large inputs and
    numpy's reductions release it too, so one call over the whole buffer overlaps whatever the
    caller does next (the dense weights' load), at the hash's full speed from memory (~19 GB/s
    here). Handing it over chunk by chunk while reading was slower on this 2-core VM
    (scripts/integrity_cost.py; README, "Files and faults"). Call :meth:`wait` before ``data`` or
    ``hasher`` is used, and before ``data``'s memory is freed.
    """

    def __init__(self) -> None:
        self._args: tuple | None = None
        self._ready, self._done = threading.Event(), threading.Event()
        self._accepted, self._error = False, None
        # why the low-level start: threading.Thread.start() blocks until the new thread runs, which
        # on a busy 2-core machine costs ~0.3 ms on the load's path; this returns after the
        # pthread_create (a daemon thread, like threading's daemon=True; _done replaces join()).
        _thread.start_new_thread(self._run, ())

    @classmethod
    def run(cls, data, hasher, check: Callable[[], bool] | None = None) -> BackgroundCheck:
        """Start the thread and hand it ``data`` at once."""
        job = cls()
        job.submit(data, hasher, check)
        return job

    def submit(self, data, hasher, check: Callable[[], bool] | None = None) -> None:
        """Hand the thread its work (once): ``hasher.update(data)``, then ``check()``."""
        self._args = (data, hasher, check)
        self._ready.set()

    def cancel(self) -> None:
        """End the thread without work (the read failed); :meth:`wait` then returns False."""
        self._ready.set()

    def _run(self) -> None:
        try:
            self._ready.wait()
            if self._args is not None:
                self._accepted = check_bytes(*self._args)
        except BaseException as exc:  # re-raised in the waiting thread
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> bool:
        """Wait for the thread's end (idempotent): True when ``check`` accepted. Raises what the thread raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._accepted
