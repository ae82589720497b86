"""Text for calibration and estimator training: read it, tokenize it, cut it into chunks.

Sources (``--data``): a .txt file, a folder of .txt files (sorted by name, read recursively), or
a .jsonl file whose lines are objects with a "text" field. Without ``--data``, the public-domain
text shipped with moespec (``moespec.data``) is used, with its own held-out part.

Documents are tokenized without special tokens and joined with the tokenizer's EOS token; the
token stream is cut into chunks of ``seq_len`` tokens, each run as one prefill pass.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from moespec.errors import DataError

BUILTIN_DESCRIPTION = "moespec built-in text: US State of the Union addresses (public domain, US government works)"


@dataclass(frozen=True)
class TextSource:
    """Documents to calibrate on.

    Attributes:
        description: where the text came from (stored in the calibration file).
        documents: the texts, in reading order.
        heldout: separate held-out documents (the built-in text has them); empty = hold out the tail.
    """

    description: str
    documents: tuple[str, ...]
    heldout: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkPlan:
    """Token chunks for calibration and for the held-out recall measurement.

    Attributes:
        calib: chunks of token ids for the default vectors and frequencies.
        heldout: disjoint chunks for recall.
        notes: what was adjusted (e.g. fewer tokens than asked), for the user.
    """

    calib: list[list[int]]
    heldout: list[list[int]]
    notes: list[str] = field(default_factory=list)

    @property
    def calib_tokens(self) -> int:
        return sum(len(c) for c in self.calib)

    @property
    def heldout_tokens(self) -> int:
        return sum(len(c) for c in self.heldout)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                        "pass a UTF-8 .txt file, a folder of them, or a .jsonl with a \"text\" field") from exc
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc.strerror}", "check the --data path and its permissions") from exc


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    for n, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path} line {n} is not JSON ({exc})", "each line must be an object with a \"text\" field") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f"{path} line {n} has no string \"text\" field", "each line must be like {\"text\": \"...\"}")
        docs.append(obj["text"])
    return docs


def load_text_source(path: str | Path | None, seed: int = 0) -> TextSource:
    """The documents at ``path`` (None = the built-in text).

    Folder and .jsonl documents are shuffled with ``seed`` (a single file is one document).

    Raises:
        DataError: the path does not exist, cannot be read, is not UTF-8, is malformed .jsonl,
            or holds no text (names the file).
    """
    if path is None:
        return builtin_source()
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"data folder {path} has no .txt files", "pass a .txt file, a folder of .txt, or a .jsonl")
        docs = [_read(p) for p in files]
        kind = f"folder {path} ({len(files)} .txt files)"
    elif path.is_file():
        docs = _read_jsonl(path) if path.suffix == ".jsonl" else [_read(path)]
        kind = f"file {path}"
    else:
        raise DataError(f"data path {path} does not exist", "pass a .txt file, a folder of .txt, or a .jsonl")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"data {kind} holds no text", "pass a file with some text in it")
    if len(docs) > 1:
        random.Random(seed).shuffle(docs)
    return TextSource(description=kind, documents=tuple(docs))


def builtin_source() -> TextSource:
    """The public-domain text shipped in ``moespec/data`` (calibration part + held-out part)."""
    try:
        import moespec.data as data_mod

        calib, heldout = data_mod.calibration_text(), data_mod.heldout_text()
        description = getattr(data_mod, "DESCRIPTION", BUILTIN_DESCRIPTION)
    except (ImportError, AttributeError):  # the data module's API is not there: read its files
        folder = Path(__file__).resolve().parent.parent / "data"
        calib = _read(folder / "sotu_calibration.txt")
        heldout = _read(folder / "sotu_heldout.txt")
        description = BUILTIN_DESCRIPTION
    return TextSource(description=description, documents=(calib,), heldout=(heldout,))


def tokenize(tokenizer, documents: tuple[str, ...] | list[str], limit: int | None = None) -> list[int]:
    """Token ids of ``documents`` joined with EOS; stops once ``limit`` tokens are reached."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in documents:
        if ids and eos is not None:
            ids.append(int(eos))
        ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
        if limit is not None and len(ids) >= limit:
            break
    return ids[:limit] if limit is not None else ids


def _cut(ids: list[int], seq_len: int, tokens: int) -> list[list[int]]:
    """Chunks of ``seq_len`` covering the first ``tokens`` ids (the last chunk may be shorter)."""
    return [ids[i : min(i + seq_len, tokens)] for i in range(0, tokens, seq_len)]


def plan_chunks(tokenizer, source: TextSource, tokens: int, heldout_tokens: int | None, seq_len: int) -> ChunkPlan:
    """Cut ``source`` into calibration and held-out chunks of ``seq_len`` tokens.

    Held-out tokens default to a tenth of ``tokens`` (at least one chunk). When the source has no
    separate held-out text, held-out chunks are taken right after the calibration chunks. When
    the data holds fewer tokens than asked, what there is gets used and a note says so.

    Raises:
        DataError: fewer tokens than one chunk (two without separate held-out text).
        OptionError: a non-positive --tokens / --seq-len / --heldout-tokens.
    """
    from moespec.errors import OptionError

    if tokens < 1:
        raise OptionError(f"--tokens {tokens} must be at least 1")
    if seq_len < 2:
        raise OptionError(f"--seq-len {seq_len} must be at least 2")
    if heldout_tokens is not None and heldout_tokens < 1:
        raise OptionError(f"--heldout-tokens {heldout_tokens} must be at least 1")
    want_heldout = heldout_tokens if heldout_tokens is not None else max(seq_len, tokens // 10)
    notes: list[str] = []
    if source.heldout:
        calib_ids = tokenize(tokenizer, source.documents, tokens)
        held_ids = tokenize(tokenizer, source.heldout, want_heldout)
        _check_one_chunk(calib_ids, seq_len, source.description)
        _check_one_chunk(held_ids, seq_len, source.description + " (held-out part)")
        if len(calib_ids) < tokens:
            notes.append(f"the data holds {len(calib_ids)} calibration tokens, fewer than --tokens {tokens}: using all of them")
        if len(held_ids) < want_heldout:
            notes.append(f"the held-out text holds {len(held_ids)} tokens: using all of them")
        return ChunkPlan(_cut(calib_ids, seq_len, len(calib_ids)), _cut(held_ids, seq_len, len(held_ids)), notes)

    ids = tokenize(tokenizer, source.documents, tokens + want_heldout)
    if len(ids) < 2 * seq_len:
        raise DataError(f"data {source.description} holds {len(ids)} tokens, fewer than two chunks of --seq-len {seq_len} "
                        "(one to calibrate, one held out to measure recall)",
                        "lower --seq-len or pass more text with --data")
    if len(ids) >= tokens + want_heldout:
        n_calib, n_held = tokens, want_heldout
    else:  # use what there is: hold out a tenth (at least one chunk), calibrate on the rest
        n_held = min(want_heldout, max(seq_len, len(ids) // 10))
        n_calib = len(ids) - n_held
        notes.append(f"the data holds {len(ids)} tokens, fewer than --tokens {tokens} + {want_heldout} held out: "
                     f"calibrating on {n_calib}, holding out {n_held}")
    held = ids[n_calib : n_calib + n_held]
    return ChunkPlan(_cut(ids, seq_len, n_calib), _cut(held, seq_len, len(held)), notes)


def _check_one_chunk(ids: list[int], seq_len: int, what: str) -> None:
    if len(ids) < seq_len:
        raise DataError(f"data {what} holds {len(ids)} tokens, fewer than one chunk of --seq-len {seq_len}",
                        "lower --seq-len or pass more text with --data")
