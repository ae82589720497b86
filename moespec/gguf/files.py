"""Which files make one GGUF model: a single .gguf, a split set, or the one model in a folder.

llama.cpp's gguf-split names the parts ``<stem>-00001-of-00003.gguf``; every part is a complete
GGUF file (its own header and tensor table), the first also holds the model's metadata. A folder
may hold several models (quant types) and vision projectors (``mmproj-*.gguf``, never a model).
Nothing here reads a tensor; the quant label comes from the file name as llama.cpp and the Hub
name it (``Qwen3-30B-A3B-Q4_K_M.gguf``, ``UD-Q4_K_XL/...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import CheckpointError, ModelNotFoundError

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# llama.cpp's quant labels as they appear in file names (Q4_K_M, UD-Q4_K_XL, IQ2_XXS, Q8_0, BF16, MXFP4_MOE).
_QUANT = re.compile(r"(?:^|[-_.])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|T?Q\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?))(?=[-.]|$)",
                    re.IGNORECASE)


@dataclass(frozen=True)
class GgufFiles:
    """One GGUF model's files.

    Attributes:
        parts: the file, or every part of a split set in order (part 1 first).
        quant: the quant label from the file name ("Q4_K_M"), or "" when the name has none.
    """

    parts: tuple[Path, ...]
    quant: str = ""

    @property
    def first(self) -> Path:
        return self.parts[0]

    @property
    def name(self) -> str:
        """The model's file name without the split suffix: ``Qwen3-30B-A3B-Q4_K_M.gguf``."""
        m = _SPLIT.match(self.first.name)
        return f"{m.group('stem')}{SUFFIX}" if m else self.first.name

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.parts)


def is_gguf(path: Path) -> bool:
    """True for a file named *.gguf (a model part or a projector)."""
    return path.suffix.lower() == SUFFIX


def is_projector(path: Path) -> bool:
    """True for a vision projector (``mmproj*.gguf``): not a language model."""
    return path.name.lower().startswith("mmproj")


def quant_label(name: str) -> str:
    """The quant label in a file or folder name (upper case, "UD-" kept), or ""."""
    found = _QUANT.findall(Path(name).name.removesuffix(SUFFIX).removesuffix(SUFFIX.upper()))
    return found[-1].upper() if found else ""


def split_parts(path: Path) -> GgufFiles:
    """The model ``path`` belongs to: itself, or every part of its split set (checked complete).

    Raises:
        CheckpointError: a part of the split set is missing (names the missing files).
    """
    m = _SPLIT.match(path.name)
    label = quant_label(path.name) or quant_label(path.parent.name)
    if m is None:
        return GgufFiles((path,), label)
    count = int(m.group("count"))
    parts = tuple(path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}{path.suffix}") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"split GGUF {m.group('stem')} has {count} parts but {len(missing)} are missing: "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}",
                              f"put every part beside {path.name} (or download them again with `moespec download`)")
    return GgufFiles(parts, label)


def models_in(folder: Path) -> list[GgufFiles]:
    """Every GGUF model in ``folder`` and its subfolders (projectors skipped), sorted by name.

    Raises:
        CheckpointError: a split set with a missing part.
    """
    seen: dict[Path, GgufFiles] = {}
    for path in sorted(folder.rglob(f"*{SUFFIX}")):
        if path.is_file() and not is_projector(path) and not any(p.startswith(".") for p in path.relative_to(folder).parts):
            files = split_parts(path)
            seen.setdefault(files.first, files)
    return sorted(seen.values(), key=lambda f: (f.name, str(f.first)))


def find_model(path: Path, quant: str | None = None) -> GgufFiles:
    """The GGUF model at ``path``: a .gguf file (a split part names its whole set) or a folder holding one.

    Args:
        path: a file or folder.
        quant: with several models in a folder, the quant label to pick (e.g. "Q4_K_M").

    Raises:
        ModelNotFoundError: no GGUF model there, or several and ``quant`` picks none (lists them).
        CheckpointError: a projector file, or a split set with a missing part.
    """
    if path.is_file():
        if is_projector(path):
            raise CheckpointError(f"{path.name} is a vision projector, not a language model",
                                  "pass the model's own .gguf file")
        return split_parts(path)
    found = models_in(path)
    if quant:
        found = [f for f in found if f.quant.upper() == quant.upper()]
    if len(found) == 1:
        return found[0]
    if not found:
        what = f" with quant {quant}" if quant else ""
        raise ModelNotFoundError(f"{path} holds no GGUF model{what}", "pass a .gguf file or a folder with one")
    labels = ", ".join(f"{f.name} ({f.quant or '?'})" for f in found[:6])
    raise ModelNotFoundError(f"{path} holds {len(found)} GGUF models: {labels}",
                             "pass one .gguf file, or append :QUANT to pick one (e.g. MODEL:Q4_K_M)")


def quant_of(path: str) -> str:
    """The quant label of a repo file: from its name, else from its folder's name."""
    return quant_label(Path(path).name) or quant_label(Path(path).parent.name)


def select_quant(paths: list[str], repo_id: str, quant: str) -> list[str]:
    """The files of ``quant``'s set among a repo's ``paths`` (every split part).

    Raises:
        CheckpointError: the repo has no GGUF files.
        ModelNotFoundError: no set of that quant (lists the quants the repo has).
    """
    ggufs = sorted(p for p in paths if is_gguf(Path(p)) and not is_projector(Path(p)))
    if not ggufs:
        raise CheckpointError(f"{repo_id} has no GGUF files", "drop --quant to download its safetensors checkpoint")
    chosen = [p for p in ggufs if quant_of(p).upper() == quant.upper()]
    if not chosen:
        have = sorted({quant_of(p) or Path(p).name for p in ggufs})
        raise ModelNotFoundError(f"{repo_id} has no {quant} GGUF; it has {', '.join(have)}",
                                 f"pass one of them with --quant, e.g. --quant {have[0]}")
    return chosen
