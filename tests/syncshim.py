"""A counting shim for host syncs, for CPU tests of code written for CUDA.

On CUDA every call that needs a device value on the host waits for the device: ``.tolist()``,
``.item()``, ``int()``/``float()``/``bool()`` of a tensor, ``nonzero``, one-argument
``torch.where``, boolean-mask indexing, ``unique``, ``bincount`` (it reads its max),
``repeat_interleave`` with tensor repeats, ``masked_select``. On CPU none of them costs anything,
so a sync-heavy runtime passes every CPU test. :class:`SyncCounter` patches these entry points
(on ``torch.Tensor`` and ``torch``, through pytest's monkeypatch, undone after the test) and counts
the calls made while it is ``active``.
"""

from __future__ import annotations

import torch

TENSOR_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "numpy",
                  "unique", "masked_select", "argwhere")
TORCH_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select", "argwhere")


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter:
    """Counts host syncs while ``active``; ``calls`` names them in order (for failure messages).

    Args:
        monkeypatch: pytest's fixture (the patches end with the test).
    """

    def __init__(self, monkeypatch) -> None:
        self.active = False
        self.calls: list[str] = []
        for name in TENSOR_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in TORCH_FUNCTIONS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        where, repeat, getitem = torch.where, torch.repeat_interleave, torch.Tensor.__getitem__

        def where_(cond, *args, **kw):
            if not args and not kw:
                self._hit("torch.where(cond)")
            return where(cond, *args, **kw)

        def repeat_(x, repeats=None, *args, **kw):
            if isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
                self._hit("repeat_interleave(tensor)")
            return repeat(x, repeats, *args, **kw) if repeats is not None else repeat(x, *args, **kw)

        def getitem_(t, index):
            if _has_bool_index(index):
                self._hit("x[bool mask]")
            return getitem(t, index)

        monkeypatch.setattr(torch, "where", where_)
        monkeypatch.setattr(torch, "repeat_interleave", repeat_)
        monkeypatch.setattr(torch.Tensor, "__getitem__", getitem_)

    @property
    def n(self) -> int:
        """Syncs counted so far."""
        return len(self.calls)

    def _hit(self, name: str) -> None:
        if self.active:
            self.calls.append(name)

    def _wrap(self, fn, name: str):
        def wrapper(*args, **kw):
            self._hit(name)
            return fn(*args, **kw)

        return wrapper

    def counted(self, fn, log: list[tuple[str, int]], label):
        """``fn`` wrapped so that each call appends (label(args), syncs during the call) to ``log``."""

        def wrapper(*args, **kw):
            was, before = self.active, self.n
            self.active = True
            try:
                return fn(*args, **kw)
            finally:
                self.active = was
                log.append((label(*args), self.n - before))

        return wrapper
