"""Per-arm result files: every scored item of one arm, written atomically, so an evaluation resumes.

``OUT/<arm>.json`` holds what its records depend on (``key``: the model, the arm, the runtime
settings that change what runs, the generation limit) and, per task, the data file's SHA-256 and one
record per item by doc_id. A run skips the items its file already has; a file made with another key
or other task data is refused (``--fresh`` starts it again). Ctrl-C loses at most the items since the
last write (at most ``SAVE_EVERY_S`` seconds of work). The file carries an XXH3-128 of the rest of
its JSON (``integrity.seal_json``); a mismatch is refused like an unreadable file, a file without it
(older) is read as before.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from moespec.errors import OutputError
from moespec.fsutil import atomic_write_text
from moespec.integrity import open_json, seal_json

FORMAT = "moespec-eval-arm"
FORMAT_VERSION = 1
SAVE_EVERY_S = 10.0


class ArmResults:
    """The records of one arm, backed by ``path``.

    Attributes:
        key: what the records depend on (JSON-able dict).
        tasks: task -> {"sha256": str, "items": {doc_id (str): record dict}, "seconds": float}.
    """

    def __init__(self, path: Path, key: dict, tasks: dict | None = None) -> None:
        self.path = path
        self.key = key
        self.tasks: dict[str, dict] = tasks or {}
        self._saved_at = time.monotonic()

    @classmethod
    def open(cls, path: Path, key: dict, fresh: bool = False) -> "ArmResults":
        """The arm's results so far (none when ``path`` does not exist or ``fresh``).

        Raises:
            OutputError: ``path`` is not a readable result file of this moespec, or was made with another key.
        """
        if fresh or not path.exists():
            return cls(path, key)
        try:
            data, intact = open_json(json.loads(path.read_text(encoding="utf-8")))
            if intact is False:  # its "xxh3" field differs from the rest: damaged like a cut file
                raise ValueError("its checksum does not match its contents")
        except (OSError, ValueError) as exc:
            raise OutputError(f"{path} is not a readable result file ({exc})",
                              "pass --fresh to start this arm again, or another --out") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise OutputError(f"{path} is not a moespec eval result file of format version {FORMAT_VERSION}",
                              "pass --fresh to start this arm again, or another --out")
        if data.get("key") != key:
            diff = sorted(k for k in set(key) | set(data.get("key", {})) if data["key"].get(k) != key.get(k))
            shown = ", ".join(f"{k} {data['key'].get(k)!r} (now {key.get(k)!r})" for k in diff[:3])
            raise OutputError(f"{path} was made with other settings: {shown}",
                              "pass --fresh to start this arm again, or another --out")
        return cls(path, key, data.get("tasks", {}))

    def records(self, task: str, sha256: str) -> dict[str, dict]:
        """The records of ``task`` (doc_id -> record), made on data with this digest.

        Raises:
            OutputError: the saved records were made on other data for this task.
        """
        entry = self.tasks.setdefault(task, {"sha256": sha256, "items": {}, "seconds": 0.0})
        if entry["sha256"] != sha256:
            raise OutputError(f"{self.path} holds {task} results made on other data (its file changed)",
                              "pass --fresh to start this arm again, or another --out")
        return entry["items"]

    def add(self, task: str, doc_id: int, record: dict, seconds: float) -> None:
        """Record one item (after ``records`` opened the task); writes the file every ``SAVE_EVERY_S``."""
        entry = self.tasks[task]
        entry["items"][str(doc_id)] = record
        entry["seconds"] += seconds
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        """Write the file atomically (fsutil)."""
        data = {"format": FORMAT, "format_version": FORMAT_VERSION, "key": self.key, "tasks": self.tasks}
        atomic_write_text(self.path, json.dumps(seal_json(data), indent=1, sort_keys=True) + "\n")
        self._saved_at = time.monotonic()
