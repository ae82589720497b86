"""KV-cache prefix reuse: which transformers cache layers can be cut back to a prefix, and cutting them.

A conversation re-renders its whole history every turn, and the new token ids often differ from the
cached ones somewhere (the answer re-tokenises differently, a template drops earlier content). The
engine keeps the keys/values of the common prefix and prefills the rest. Keeping a prefix means
removing the last ``n - keep`` positions of every cache layer; whether that is possible depends on
the layer class (transformers/cache_utils.py):

- ``DynamicLayer`` (full attention; also MLA models, whose keys and values differ in head size)
  holds every position: it can always be cut.
- ``DynamicSlidingWindowLayer`` (GPT-OSS, Mixtral/Qwen2 with a window) holds only the last
  ``window - 1`` positions once ``window`` tokens were seen: cut positions cannot come back. Before
  that it holds all of them. With past recording on (``activate_past_recording``, transformers
  >= 5.2x) it keeps every position until the next crop, which then restricts it to the window
  again: a cut is exact while the positions it needs (the ``window - 1`` before the new end) are held.
- any other layer class (quantised, static, linear attention, indexed): not cut here; the caller
  prefills from scratch (correct first, then fast).

Crops use negative counts (``crop(-r)`` removes r positions), the form transformers 5.17 and 5.24
both accept (5.24 refuses a positive length).
"""

from __future__ import annotations


def _classes():
    from transformers import cache_utils

    return cache_utils.DynamicLayer, getattr(cache_utils, "DynamicSlidingWindowLayer", None)


def layer_length(layer) -> int:
    """Tokens seen by one cache layer (positions it represents, held or not)."""
    return int(layer.get_seq_length())


def can_cut(layer, remove: int) -> bool:
    """True when removing the last ``remove`` positions of ``layer`` leaves an exact cache.

    Exact class checks on purpose: a subclass may carry state that a plain cut would desync.
    """
    if remove == 0:
        return True
    full, sliding = _classes()
    if type(layer) is full:
        return True
    if sliding is not None and type(layer) is sliding:
        window = int(layer.sliding_window)
        seen = layer_length(layer)
        if seen < window:
            return True  # every position is still held
        held = int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0
        # It holds positions [seen - held, seen); after the cut it needs the window - 1 positions
        # before the new end (all of them when the new end is inside the first window).
        need_from = max(0, seen - remove - (window - 1))
        return bool(getattr(layer, "record_past", False)) and seen - held <= need_from
    return False


def record_past(kv) -> None:
    """Make sliding-window layers keep past positions so a later cut stays exact (when supported).

    Costs memory like a full-attention layer for those layers (the conversation's keys/values).
    """
    activate = getattr(kv, "activate_past_recording", None)
    if activate is not None:
        activate()


def truncate(kv, keep: int) -> bool:
    """Cut every layer of ``kv`` back to its first ``keep`` positions.

    Returns False, leaving ``kv`` untouched, when some layer cannot be cut exactly (or holds fewer
    than ``keep`` positions); the caller then drops the cache and prefills from scratch.
    """
    layers = getattr(kv, "layers", None)
    if layers is None:
        return False
    plan = []
    for layer in layers:
        seen = layer_length(layer)
        if seen < keep or not can_cut(layer, seen - keep):
            return False
        plan.append((layer, seen - keep))
    for layer, remove in plan:  # only after every layer was checked: never half-cut
        if remove:
            layer.crop(-remove)
    return True
