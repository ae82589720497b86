"""One device slot of the expert cache: what it holds, its pins, its copy (one record per slot), and
what acquiring one for compute returns.

A slot's state says what its bytes are; pins and the copy in flight are separate, since a slot in
any state but EMPTY may be pinned, and a copy into it may still be running.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moespec.runtime.transfer.base import Ticket

Key = tuple[int, int]  # (decoder layer index, expert id)


class SlotState(enum.Enum):
    """What a slot's bytes are (ExpertCache's prefetch rule, slots.py)."""

    EMPTY = "empty"  # nothing: taken first by any copy
    CACHED = "cached"  # an expert a compute used, or a demand copy
    PREDICTED = "predicted"  # a prefetch copy whose target layer has not settled it (runtime/cache/ledger.py)
    UNUSED = "unused"  # a prefetch copy its target layer ran without: the next copy's slot
    RESTORED = "restored"  # the expert a cancelled prefetch displaced: its bytes were never overwritten,
    #                        so it is back, and first in the eviction order once its pin drops


@dataclass(slots=True, eq=False)
class Slot:
    """The record of slot ``index``.

    Attributes:
        index: the slot's row in ``ExpertCache.slots``.
        key: the expert it holds (or is receiving), None when EMPTY.
        state: what its bytes are.
        pins: users that keep it from eviction (the running layer, a prefetch for a later layer).
        ticket: the copy into it that compute has not waited for yet (None: nothing to wait for).
        issued_s: perf_counter when that copy was issued (the miss planner's age of a copy).
        displaced: what a PREDICTED copy overwrote (given back if the copy is cancelled).
    """

    index: int
    key: Key | None = None
    state: SlotState = SlotState.EMPTY
    pins: int = 0
    ticket: Ticket | None = None
    issued_s: float = 0.0
    displaced: Key | None = None

    @property
    def predicted(self) -> bool:
        """Holds a prediction no compute has used (PREDICTED or UNUSED): reused before the rule's victim."""
        return self.state is SlotState.PREDICTED or self.state is SlotState.UNUSED


@dataclass
class Acquired:
    """Result of acquiring an expert for compute.

    Attributes:
        slot: slot index.
        hit: the expert was resident (or already in flight) before this request.
        prefetched: it was there because a prefetch brought it and this is its first use.
    """

    slot: int
    hit: bool
    prefetched: bool
