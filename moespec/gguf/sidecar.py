"""The folder moespec prepares for a GGUF model: what the rest of moespec reads from a model folder.

``<moespec home>/gguf/<key>/`` holds config.json (config.py, from the metadata), the tokenizer and
chat template (transformers' GGUF tokenizer reader, saved as tokenizer.json), generation_config.json
(end-of-turn ids) and ``moespec-gguf.json``: the key the model is known by (the .gguf path, or
"org/repo:QUANT"), the parts, each part's fingerprint and the file's tensor table. It is made on
first use (seconds: the tokenizer conversion dominates) and reused while every part's size, mtime
and header hash are unchanged, so a second start reads neither the metadata nor the vocabulary
again. Writing goes to a temporary folder renamed into place, so a half-made folder is never used.
The marker records an XXH3-128 digest of every other file in the folder and of itself
(moespec.integrity): a folder whose files or marker were damaged is made again, never read.
"""

from __future__ import annotations

import json
from pathlib import Path

from moespec.artifacts import gguf_marker_digest
from moespec.errors import CheckpointError
from moespec.fsutil import atomic_folder
from moespec.gguf import SOURCE_FILE
from moespec.gguf.files import GgufFiles
from moespec.gguf.reader import GgufCheckpoint, fingerprint

FORMAT = 2  # 2: the marker records the digests of the folder's files and of itself


def sidecar_dir(key: str) -> Path:
    """Where the prepared folder of the GGUF model known as ``key`` lives."""
    from moespec.artifacts import sanitize_model_id
    from moespec.paths import moespec_home

    return moespec_home() / "gguf" / sanitize_model_id(key)


def read_marker(folder: Path) -> dict | None:
    """The parsed moespec-gguf.json of ``folder``, or None when absent, unreadable, of another format,
    or when it or a file it lists does not match its digest (damaged: made again)."""
    try:
        data = json.loads((Path(folder) / SOURCE_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        files = data["files"]
        if data.get("digest") != gguf_marker_digest(data) or files != _file_digests(Path(folder), list(files)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data


def _file_digests(folder: Path, names: list[str] | None = None) -> dict[str, str]:
    """{name: XXH3-128 of its bytes} of the files ``names`` of ``folder`` (default: every file but the
    marker: what prepare wrote; files added later, such as the dense cache, check themselves)."""
    from moespec.integrity import file_digest

    if names is None:
        names = [p.name for p in folder.iterdir() if p.is_file() and p.name != SOURCE_FILE]
    return {name: file_digest(folder / name) for name in sorted(names)}


def is_current(data: dict, files: GgufFiles | None = None) -> bool:
    """True when the marker describes ``files`` (default: its own parts) as they are on disk now."""
    parts = [Path(p) for p in data["checkpoint"]["parts"]]
    if files is not None and list(files.parts) != parts:
        return False
    try:
        now = [fingerprint(p, n) for p, n in zip(parts, data["checkpoint"]["header_bytes"])]
    except OSError:
        return False
    return now == data["fingerprints"]


def default_dtype(ck: GgufCheckpoint) -> str:
    """The compute dtype a GGUF implies: float32 for an all-F32 file, else its half type (bfloat16 for quants)."""
    from gguf import GGMLQuantizationType as Q

    types = {t.ggml_type for t in ck.tensors.values()}
    if types <= {Q.F32}:
        return "float32"
    if Q.F16 in types and types <= {Q.F32, Q.F16}:
        return "float16"
    return "bfloat16"


def prepare(files: GgufFiles, key: str) -> Path:
    """The prepared folder of ``files`` (made now when missing or stale).

    Raises:
        UnsupportedModelError: an architecture moespec does not run, or a dense model.
        CheckpointError: a truncated or unreadable file, or a tensor the model needs is missing.
        OutputError: moespec's home is not writable.
    """
    folder = sidecar_dir(key)
    data = read_marker(folder)
    if data is not None and data.get("key") == key and is_current(data, files):
        return folder
    ck = GgufCheckpoint.open(files)
    from moespec.gguf.config import hf_config

    config = hf_config(ck, default_dtype(ck))  # unsupported or dense: refused before anything is written
    _check_experts(ck)
    with atomic_folder(folder) as tmp:  # a locked temp folder: swept by the next prepare after a SIGKILL
        config.save_pretrained(tmp)
        _write_tokenizer(files, tmp)
        _write_generation_config(ck, tmp)
        marker = {"format": FORMAT, "key": key, "fingerprints": ck.fingerprints(), "checkpoint": ck.to_json(),
                  "files": _file_digests(tmp)}
        marker = json.loads(json.dumps(marker))  # as it reads back (tuples become lists), then sealed
        marker["digest"] = gguf_marker_digest(marker)
        (tmp / SOURCE_FILE).write_text(json.dumps(marker), encoding="utf-8")
    return folder


def _check_experts(ck: GgufCheckpoint) -> None:
    """Raise unless every MoE block of the file has its three expert tensors."""
    gates = {n.split(".")[1] for n in ck.tensors if n.endswith(".ffn_gate_exps.weight")}
    for layer in sorted(gates, key=int):
        for part in ("up", "down"):
            if f"blk.{layer}.ffn_{part}_exps.weight" not in ck.tensors:
                raise CheckpointError(f"{ck.files.name} has blk.{layer}.ffn_gate_exps but no blk.{layer}.ffn_{part}_exps",
                                      "the file is incomplete: download it again")
    if not gates:
        raise CheckpointError(f"{ck.files.name} has no fused expert tensors (blk.N.ffn_gate_exps.weight)",
                              "convert the model with a recent llama.cpp (convert_hf_to_gguf.py merges the experts)")


def _write_tokenizer(files: GgufFiles, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from the file's tokenizer metadata.

    Raises:
        CheckpointError: the metadata describes no tokenizer transformers can build.
    """
    from transformers import TokenizersBackend

    try:
        tokenizer = TokenizersBackend.from_pretrained(str(files.first.parent), gguf_file=files.first.name)
    except Exception as exc:  # transformers raises ValueError/KeyError for tokenizers it cannot build
        raise CheckpointError(f"{files.name}: transformers cannot build its tokenizer ({type(exc).__name__}: {exc})",
                              "the file's tokenizer.ggml.* metadata is missing or of an unsupported kind") from exc
    tokenizer.save_pretrained(folder)


def _write_generation_config(ck: GgufCheckpoint, folder: Path) -> None:
    """End-of-turn ids: llama.cpp's eos, eot and eom ids (chat.render reads eos_token_id from here)."""
    eos = [ck.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    gen = {"eos_token_id": sorted({int(t) for t in eos if t is not None})}
    for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        if ck.get(f"tokenizer.ggml.{key}_token_id") is not None:
            gen[name] = int(ck.get(f"tokenizer.ggml.{key}_token_id"))
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
