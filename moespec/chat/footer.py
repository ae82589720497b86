"""The chat footer: one line of an answer's Summary, under 80 columns.

Kept out of the runtime: what a person reads is the chat's, the numbers are runtime/stats.py's.
"""

from __future__ import annotations

from moespec.runtime.stats import Summary


def footer(summary: Summary, policy: str | None = None, host: bool = False) -> str:
    """One line for the chat UI, at most 80 characters for any value below 10,000 (3 significant
    digits, e.g. ``11.6 tok/s · TPOT 86.2 ms · recall@K 0.82 · H2D 0.00 MB/tok · stall 0.00 ms/tok``).

    With ``policy`` (the cache policy's name: lru, lfu, lfru or static) the line ends with it and
    leaves out tok/s (TPOT says the same for decode), so it still fits 80 columns.
    With ``host`` (``--on-miss host|auto``) it also names the experts computed on the host per
    token; every value after TPOT is per token, so the units drop their "/tok" to fit, e.g.
    ``TPOT 86.2 ms · recall@K n/a · H2D 1.57 MB · stall 0.78 ms · host 117 · lfru``.
    """
    rec = "n/a" if summary.recall is None else f"{summary.recall:.2f}"
    per = "" if host else "/tok"  # with host: every value after TPOT is per token, said once by TPOT
    rest = (f"TPOT {_short(summary.tpot_ms)} ms · recall@K {rec} · H2D {_short(summary.h2d_mb_per_token)} MB{per} · "
            f"stall {_short(summary.stall_ms_per_token)} ms{per}")
    if host:
        rest += f" · host {_short(summary.host_experts_per_token)}"
    elif policy is None:
        return f"{_short(summary.tokens_per_s)} tok/s · {rest}"
    return rest if policy is None else f"{rest} · {policy}"


def _short(x: float) -> str:
    """``x`` with about 3 significant digits: 0.00 .. 9.99, 10.0 .. 99.9, then whole numbers."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"
