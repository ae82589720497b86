"""The native CPU kernels (csrc/*.c): built once per machine with the system C compiler, loaded by ctypes.

Why C through ctypes, not a library kernel: on an AVX2 CPU without AVX-512 PyTorch's packed CPU
ops (which torchao's CPU layouts call) are exact only with bfloat16 activations and outputs, take
int8 with per-channel scales only and need K a multiple of the group; with float32 activations
they run scalar loops. These kernels are exact with float32 activations and faster at t = 1
(docs/decisions.md, 2026-12-01 "Host experts through moespec's own C kernels"). ctypes releases
the GIL for the call, so pool threads run kernels in parallel.

Build: ``$CC`` (default ``cc``) with ``-O3 -mavx2 -mfma -mf16c`` (:data:`FLAGS`), once per source/compiler/flags
(the file name carries their hash) into ``<moespec home>/kernels/``, written atomically (fsutil), its bytes
checked against the XXH3-128 written beside it before every load (a damaged library is compiled again).
Without AVX2/FMA/F16C, without a compiler, or with ``MOESPEC_CPU_KERNELS=0`` there is no library
and callers use the reference path (dequantise, then ``F.linear``); :func:`status` says why, in one line.
Where the CPU has AVX-512 (F/BW/VL/VNNI/BF16, :data:`NEEDED_512`) csrc/avx512.c's kernels run for one
token and for int8 activations (``MOESPEC_CPU_ISA=avx2`` keeps AVX2; :func:`set_isa` switches at run
time); ``Status.isa_note`` says in one line why they do not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")  # every *.c there (avx512*.c: an AVX-512 target): one library
# -fno-tree-loop-distribute-patterns: gcc turned the kernels' small copy loops into ``rep movsq``,
# which took half the time of the several-token kernel on this project's AMD VM (perf annotate).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fno-tree-loop-distribute-patterns", "-shared", "-fPIC", "-std=gnu11")
NEEDED = ("avx2", "fma", "f16c")
KIND_F32, KIND_BF16, KIND_Q8, KIND_Q4 = 0, 1, 2, 3
FALLBACK = "experts computed on the CPU use the reference path (dequantise, then matmul)"
# csrc/avx512.c (compiled for AVX-512 by a target pragma; the rest of the library stays AVX2) runs
# where the CPU has these (/proc/cpuinfo names) and MOESPEC_CPU_ISA is not "avx2".
NEEDED_512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
ISAS = ("avx2", "avx512")

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "group_sums": (None, [_P, _I, _I, _I, _I, _P]),
    "linear_f32act": (ctypes.c_int, [ctypes.c_int, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I]),
    "quantize_act": (None, [_P, _I, _I, _I, _I, _P, _P, _P]),
    "linear_a8": (ctypes.c_int, [ctypes.c_int, _P, _P, _P, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I]),
    "dequant_q4": (None, [_P, _P, _P, _I, _I, _P, _I, _I]),
    "dequant_q8": (None, [_P, _P, _P, _I, _I, _P, _I, _I]),
    "silu_mul": (None, [_P, _I, _I, _P, ctypes.c_int]),
    "router_topk": (ctypes.c_int, [_P, _I, _I, _I, ctypes.c_int, _P, _P]),  # router.c (runtime/router_call.py)
    "expert_swiglu": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _I, _P, _I, _I, _I, _I, _I, _I,
                                     _I, _I, _I, _P]),
    "experts_swiglu": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _I, _P, _I, _P, _I, _I, _I, _I,
                                      _I, _I, _I, _I, _I, _I, _P]),
    "host_experts": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _I, _I, _I, _I, _I, _I, _I, _I,
                                    _I, _I, _P, _P]),
    "host_experts_wait": (ctypes.c_int, [_P, _I, _I]),
    "cpu_isa": (ctypes.c_int, [ctypes.c_int]),
    # spin.c: bound weights and the spinning row pool (kernels/spin.py)
    "spin_bind": (_P, [ctypes.c_int, _P, _P, _P, _I, _I, _I]),
    "spin_unbind": (None, [_P]),
    "spin_pool_new": (_P, [ctypes.c_int]),
    "spin_pool_free": (None, [_P]),
    "spin_linear": (ctypes.c_int, [_P, _P, _P, _I, _P, _I, _P, _P]),
    "spin_quiet": (None, [_P]),
    "spin_pool_set_split_min_bytes": (None, [_P, _I]),
    "spin_experts": (ctypes.c_int, [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _I, _P, _I, _P, _I, _I, _I,
                                    _I, _I, _I, _I, _I, _I, _I, _P]),
    "rms_norm": (None, [_P, _I, _I, _P, ctypes.c_float, _P]),  # norm.c (kernels/norm.py)
}


@dataclass(frozen=True)
class Status:
    """Whether the native kernels are in use.

    Attributes:
        lib: the loaded library (None: callers use the reference path).
        note: None, or one line saying why there is no library and what runs instead.
        isa: the kernels' instruction set at load, "avx512" or "avx2" (None without a library).
        isa_note: None, or one line saying why the AVX-512 kernels do not run.
    """

    lib: ctypes.CDLL | None
    note: str | None
    isa: str | None = None
    isa_note: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; elsewhere what torch's dispatch level implies)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    level = torch.backends.cpu.get_cpu_capability()  # "AVX2" / "AVX512" imply FMA and F16C on x86
    return set(NEEDED) if level in ("AVX2", "AVX512") else set()


def _build(out_dir: Path, cc: str) -> Path:
    """The compiled library for this source, compiler and flags (compiled now if absent or damaged).

    Its name carries the hash of what it is built from; ``NAME.so.xxh3`` beside it the XXH3-128 of
    its bytes, written after it (moespec.integrity). A library whose bytes do not match (a flipped
    byte could crash the process or compute wrong values), or that has no such file (a kill between
    the two writes, or built before them), is compiled again (~1 s) before it is loaded.
    """
    from moespec.fsutil import atomic_path, atomic_write_text
    from moespec.integrity import file_digest

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    files = sorted(CSRC.glob("*.[ch]"))
    digest = hashlib.sha256(" ".join(FLAGS).encode() + version.encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    lib = out_dir / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    mark = lib.with_name(lib.name + ".xxh3")
    if not _intact(lib, mark):
        with atomic_path(lib) as tmp:
            sources = [str(f) for f in files if f.suffix == ".c"]
            subprocess.run([cc, *FLAGS, "-o", str(tmp), *sources, "-lm"], check=True, capture_output=True,
                           timeout=300)
        atomic_write_text(mark, file_digest(lib) + "\n")
    return lib


def _intact(lib: Path, mark: Path) -> bool:
    """True when ``lib`` exists and its bytes match the checksum in ``mark``."""
    from moespec.integrity import file_digest

    try:
        return mark.read_text(encoding="utf-8").strip() == file_digest(lib)
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def status() -> Status:
    """The native library, built and loaded on first use (about 1 s to compile), or why not."""
    if os.environ.get("MOESPEC_CPU_KERNELS", "1") == "0":
        return Status(None, f"MOESPEC_CPU_KERNELS=0: {FALLBACK}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return Status(None, f"no native kernels for {platform.machine()}: {FALLBACK}")
    missing = [f for f in NEEDED if f not in cpu_flags()]
    if missing:
        return Status(None, f"this CPU lacks {'/'.join(m.upper() for m in missing)}: {FALLBACK}")
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return Status(None, f"no C compiler ({cc}) to build the CPU kernels: {FALLBACK}")
    from moespec.errors import MoespecError
    from moespec.paths import moespec_home

    try:
        lib = ctypes.CDLL(str(_build(moespec_home() / "kernels", cc)))
    except (OSError, subprocess.SubprocessError, MoespecError) as exc:
        why = getattr(exc, "stderr", b"") or str(exc).encode()
        first = why.decode(errors="replace").strip().splitlines()[:1] or ["failed"]
        return Status(None, f"building the CPU kernels failed ({first[0][:80]}): {FALLBACK}")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    isa, isa_note = _choose_isa(lib)
    return Status(lib, None, isa, isa_note)


def _choose_isa(lib: ctypes.CDLL) -> tuple[str, str | None]:
    """Switch the library to AVX-512 where the CPU has it and MOESPEC_CPU_ISA allows; (isa, note)."""
    want = os.environ.get("MOESPEC_CPU_ISA", "auto").lower()
    missing = [f for f in NEEDED_512 if f not in cpu_flags()]
    if want == "avx2":
        note = "MOESPEC_CPU_ISA=avx2: the CPU kernels use AVX2"
    elif want not in ("auto", "avx512"):
        note = f"MOESPEC_CPU_ISA={want[:8]} is not auto, avx2 or avx512: the CPU kernels use AVX2"
    elif missing:
        note = f"this CPU lacks {'/'.join(m.upper() for m in missing)}: the CPU kernels use AVX2"
    else:
        note = None
    on = lib.cpu_isa(1 if note is None else 0)
    if note is None and not on:  # /proc/cpuinfo lists them, the OS does not save zmm state
        note = "the OS does not enable AVX-512: the CPU kernels use AVX2"
    return ISAS[on], note


def isa_notice() -> str | None:
    """The ISA note a user should see (once, in the loader's notes), or None.

    Only where this CPU has every AVX-512 feature the kernels need and they are off anyway
    (MOESPEC_CPU_ISA=avx2 or an unknown value, or the OS does not save zmm state): then the user
    runs slower kernels than the CPU allows. A CPU without AVX-512 runs its best kernels: no note.
    """
    s = status()
    if s.lib is None or s.isa_note is None or any(f not in cpu_flags() for f in NEEDED_512):
        return None
    return s.isa_note


def set_isa(name: str) -> str:
    """Run the kernels with ``name`` ("avx2" or "avx512", where the CPU has it); returns the previous.

    For tests and benchmarks (the two kernels side by side in one process). Raises ValueError for an
    unknown name; "avx512" on a CPU without it stays on AVX2 (see :func:`current_isa`).
    """
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}: one of {', '.join(ISAS)}")
    lib = library()
    if lib is None:
        return name
    before = ISAS[lib.cpu_isa(-1)]
    lib.cpu_isa(ISAS.index(name))
    return before


def current_isa() -> str | None:
    """The kernels' instruction set now, "avx512" or "avx2" (None without a library)."""
    lib = library()
    return None if lib is None else ISAS[lib.cpu_isa(-1)]


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (the reference path runs)."""
    return status().lib
