"""Instance forwards that moespec installs over a module's own (dense.py, norm_call.py), undone alike."""

from __future__ import annotations

from torch import nn


def restore_forwards(undo: list[tuple[nn.Module, object]]) -> None:
    """Put back what each module's instance ``forward`` was before moespec replaced it, newest first,
    and empty ``undo``. An entry is (module, its ``__dict__["forward"]`` before, or None when the
    class's forward ran: the instance attribute is then deleted)."""
    for module, before in reversed(undo):
        if before is None:
            del module.forward
        else:
            module.forward = before
    undo.clear()
