"""MODEL's folder checked before anything loads: config.json and the tokenizer, one line per fault.

transformers meets a bad config or tokenizer deep inside a load, with a traceback (an invalid
config.json, ``num_experts_per_tok`` above the experts: "selected index k out of range"; a
non-float dtype; a truncated tokenizer.json: a JSONDecodeError), or not at all (``num_experts_per_tok``
0 runs with no experts; a folder without tokenizer files gets an empty tokenizer, so every prompt
is "empty"). :func:`check_config` and :func:`load_tokenizer` say each of these in one line naming
the file, the field and what it may hold, before the weights are read.
"""

from __future__ import annotations

import json
from pathlib import Path

from moespec.errors import CheckpointError

# What transformers reads a tokenizer from (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# config.json fields naming the routed experts per MoE layer, by family (the first present counts).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def read_config(folder: Path) -> dict:
    """config.json of ``folder`` as a dict (its ``text_config`` merged over it, as for multimodal models).

    Raises:
        CheckpointError: missing, unreadable or not a JSON object (names the file and where it breaks).
    """
    path = Path(folder) / "config.json"
    redo = "download the model again (`moespec download MODEL`) or fix the file"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json", "pass a model folder or run `moespec download MODEL`") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text (not UTF-8)", redo) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
                              redo) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}", redo) from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object", redo)
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def check_config(folder: Path, dtype: str = "auto") -> dict:
    """Refuse a config.json moespec cannot run, naming the field; returns it (read_config).

    Args:
        folder: the model folder.
        dtype: ``--dtype`` ("auto" reads the checkpoint's, which must then be a float dtype).

    Raises:
        CheckpointError: invalid JSON; ``num_experts_per_tok`` not an integer in [1, experts];
            a non-float dtype with ``--dtype auto``.
    """
    config = read_config(folder)
    path = Path(folder) / "config.json"
    experts_field = next((f for f in EXPERT_FIELDS if config.get(f) is not None), None)
    k = config.get("num_experts_per_tok")
    if experts_field is not None and k is not None:
        e = config[experts_field]
        if not _is_int(e) or e < 1:
            raise CheckpointError(f"{path}: {experts_field} {e!r} must be a whole number of experts, at least 1",
                                  "the config does not describe an MoE model moespec can run")
        if not _is_int(k) or not 1 <= k <= e:
            raise CheckpointError(f"{path}: num_experts_per_tok {k!r} must be a whole number from 1 to "
                                  f"{experts_field} ({e})", "fix num_experts_per_tok in config.json")
    if dtype == "auto":
        found = config.get("dtype") or config.get("torch_dtype")
        if found is not None and found not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: dtype {found!r} is not a float dtype moespec computes in "
                                  f"({', '.join(FLOAT_DTYPES)})", "pass --dtype float32, bfloat16 or float16")
    return config


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tokenizer_files(folder: Path) -> None:
    """Refuse a folder with no tokenizer files (transformers would build an empty tokenizer).

    Raises:
        CheckpointError: names the files looked for.
    """
    if not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                              "download the model again (`moespec download MODEL` fetches the tokenizer)")


def load_tokenizer(folder: Path, dtype: str = "auto"):
    """The folder's transformers tokenizer, or one line saying why there is none.

    config.json is checked first (:func:`check_config` with ``dtype`` = ``--dtype``): AutoTokenizer
    reads it too, and its faults are named as such.

    Raises:
        CheckpointError: an invalid config.json, no tokenizer files, or a missing / truncated /
            invalid one (any error the tokenizer libraries raise: ValueError, OSError, bare Exception).
    """
    from transformers import AutoTokenizer

    check_config(folder, dtype)
    check_tokenizer_files(folder)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for bad files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = "a file is truncated or not valid JSON: " if isinstance(exc, json.JSONDecodeError) else ""
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {what}{first}",
                              "the model folder needs its tokenizer files (tokenizer.json or similar); "
                              "download the model again") from None
