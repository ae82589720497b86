"""``moespec profile --copy-share S``: the emulated link set so on-demand copies are S of on-demand TPOT.

Ratios between strategies depend on how much of a token the copies take: on a machine with fast
compute the same emulated GB/s makes copies a larger share. So, in the same run: an on-demand
probe (predictor none, copies unthrottled) measures T0, the TPOT with (almost) free copies, and
B, the bytes it copies per token. On demand a token waits for its copies, so TPOT = T0 + C with
C = B / link; copies are S of it when C = S / (1 - S) x T0, so the link is set to B / C. The
report records S asked, T0, B, the link set and the share reached, (TPOT_none - T0) / TPOT_none
of the timed on-demand run (profile/report.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from moespec.errors import OptionError


@dataclass(frozen=True)
class CopyShare:
    """The probe's measurements and the link they set.

    Attributes:
        asked: S, the share of on-demand TPOT the copies should take (0 < S < 1).
        probe_tpot_ms: T0, on-demand TPOT with unthrottled copies (ms).
        bytes_per_token: B, on-demand H2D bytes per decode token in the probe.
        link_gbps: the emulated link set, B / (S / (1 - S) x T0), in GB/s (10^9 bytes/s).
    """

    asked: float
    probe_tpot_ms: float
    bytes_per_token: float
    link_gbps: float

    def reached(self, tpot_none_ms: float) -> float | None:
        """The share the copies took in a timed on-demand run of ``tpot_none_ms``: (TPOT - T0) / TPOT."""
        return (tpot_none_ms - self.probe_tpot_ms) / tpot_none_ms if tpot_none_ms > 0 else None


def check_copy_share(share: float | None, device: str) -> None:
    """Refuse a share outside (0, 1) or off the CPU's emulated link (with --link-gbps too, the share
    decides: the link given only serves the model's load).

    Raises:
        OptionError: one line naming --copy-share.
    """
    if share is None:
        return
    if not 0.0 < share < 1.0:
        raise OptionError(f"--copy-share {share} must be between 0 and 1 (e.g. 0.75)")
    if not device.startswith("cpu"):
        raise OptionError(f"--copy-share needs the emulated link of --device cpu, not {device}",
                          "pass --device cpu, or drop --copy-share")


def _link(om):
    """The CPU transfer engine under the profile's copy log (probes.py wraps it as ``inner``).

    Raises:
        OptionError: the engine has no emulated link (not the CPU thread engine).
    """
    engine = om.cache.engine
    while hasattr(engine, "inner"):
        engine = engine.inner
    if not hasattr(engine, "link_gbps"):
        raise OptionError("--copy-share needs the emulated link of --device cpu", "pass --device cpu")
    return engine


def unthrottle(om) -> None:
    """Copies as fast as memcpy for the probe (the CPU transfer engine's emulated link off)."""
    _link(om).link_gbps = None


def set_share(om, share: float, probe_steps) -> CopyShare:
    """Set the emulated link from the probe's decode steps (StepRecord list of an on-demand run).

    Raises:
        OptionError: the probe copied nothing (every expert resident: names --cache-experts).
    """
    t0 = statistics.fmean(s.wall_ms for s in probe_steps)
    nbytes = statistics.fmean(sum(st.h2d_bytes for st in s.layers.values()) for s in probe_steps)
    if nbytes <= 0:
        raise OptionError("--copy-share: on-demand loading copied nothing, so no link speed gives a share",
                          "pass a smaller --cache-experts or --gpu-memory")
    copy_ms = share / (1.0 - share) * t0
    gbps = nbytes / (copy_ms * 1e-3) / 1e9
    _link(om).link_gbps = gbps
    return CopyShare(share, t0, nbytes, gbps)
