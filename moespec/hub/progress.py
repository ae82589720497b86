"""Bridge huggingface_hub's tqdm-style progress reporting to a plain byte callback.

snapshot_download reports progress through instances of its ``tqdm_class`` argument: one
file-count bar and two byte bars (network transfer and bytes written), both fed from every file.
:func:`byte_progress_class` returns such a class that draws nothing and calls
``on_bytes(done_bytes)`` with the larger of the byte bars' counters, so the caller (the CLI's Rich
display) sees bytes downloaded without depending on which bar is which.
"""

from __future__ import annotations

import threading
from typing import Callable


def byte_progress_class(on_bytes: Callable[[int], None]) -> type:
    """A tqdm-compatible class whose byte bars report to ``on_bytes(bytes_done)`` (thread-safe)."""
    lock = threading.Lock()
    byte_bars: list["_Bar"] = []

    class _Bar:
        def __init__(self, *args, **kwargs) -> None:
            self.total = kwargs.get("total") or 0
            self.n = kwargs.get("initial") or 0
            self.desc = kwargs.get("desc", "")
            self.is_bytes = kwargs.get("unit") == "B"
            self.format_dict: dict = {"rate": None}
            if self.is_bytes:
                with lock:
                    byte_bars.append(self)

        def update(self, n: int | float | None = 1) -> None:
            if not self.is_bytes:
                return
            with lock:
                self.n += int(n or 0)
                done = max(bar.n for bar in byte_bars)
            on_bytes(done)

        def __enter__(self) -> "_Bar":
            return self

        def __exit__(self, *exc) -> None:
            self.close()

        def close(self) -> None:
            pass

        def refresh(self, *args, **kwargs) -> None:
            pass

        def set_description(self, *args, **kwargs) -> None:
            pass

        set_description_str = set_postfix_str = set_description

    return _Bar
