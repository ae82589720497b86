"""Stop strings over streamed text: emit only text that can no longer become part of a stop.

A stop string may span several tokens. The matcher holds back the longest tail of the text
that is a prefix of some stop string; everything before it is final. When a stop string
appears, the text before it is the last piece and generation ends (the stop string itself is
not returned, as in OpenAI's API).
"""

from __future__ import annotations


class StopMatcher:
    """Filters streamed text pieces against ``stops``.

    Args:
        stops: stop strings (empty: every piece passes unchanged).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; returns (final text to emit, True when a stop string matched)."""
        if not self.stops:
            return piece, False
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return text[:min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """Text held back when generation ended without a match (it is final now)."""
        held, self._held = self._held, ""
        return held
