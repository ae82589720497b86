"""PNG plot of a profile report: TPOT breakdown per strategy (stacked bars) and recall per layer;
with guarded arms, a last row of bytes vs quality per τ (top-1 agreement, perplexity × exact).

matplotlib is an optional extra (``pip install 'moespec[plot]'``), imported only here and only
when a plot is asked for.
"""

from __future__ import annotations

import os

from moespec.errors import OptionError
from moespec.fsutil import atomic_path
from moespec.profile.strategy import base_name


def require_matplotlib() -> None:
    """Raises OptionError (saying how to install it) when matplotlib is absent."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise OptionError("--plot needs matplotlib, which is not installed",
                          "pip install 'moespec[plot]' (or pip install matplotlib), or drop --plot") from None


def write_plot(rep: dict, path: str | os.PathLike) -> None:
    """One row per prompt length: left, TPOT = compute + stall per strategy with the floor and the
    on-demand bound as markers; right, recall@K per layer for each predicting strategy."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from moespec.profile.guard_view import guard_rows

    plens = list(dict.fromkeys(r["prompt_len"] for r in rep["results"]))
    guard = guard_rows(rep, plens[0]) if plens else []
    nrows = len(plens) + (1 if guard else 0)
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 3.8 * nrows), squeeze=False)
    if guard:
        _guard_curve(axes[-1], guard, plens[0])
    for row, plen in enumerate(plens):
        res = [r for r in rep["results"] if r["prompt_len"] == plen]
        ax = axes[row][0]
        names = [r["strategy"] for r in res]
        stall = [r["stall_ms_per_token"] for r in res]
        busy = [max(0.0, r["tpot_ms"]["mean"] - s) for r, s in zip(res, stall)]
        x = range(len(res))
        ax.bar(x, busy, label="compute (not waiting)", color="#4c72b0")
        ax.bar(x, stall, bottom=busy, label="stall on copies", color="#dd8452")
        ax.errorbar(x, [r["tpot_ms"]["mean"] for r in res], yerr=[r["tpot_ms"]["std"] for r in res],
                    fmt="none", ecolor="black", capsize=3)
        ax.scatter(x, [r["bounds"]["floor_ms"] for r in res], marker="_", s=600, color="green", zorder=3,
                   label="overlap floor")
        ax.scatter(x, [r["bounds"]["on_demand_ms"] for r in res], marker="_", s=600, color="red", zorder=3,
                   label="on-demand bound")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms per output token")
        ax.set_title(f"TPOT, prompt {plen}")
        ax.legend(fontsize=7, loc="lower right")
        ax = axes[row][1]
        for r in res:
            pts = [(p["layer"], p["recall"]) for p in r["per_layer"] if p["recall"] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=r["strategy"])
        ax.set_ylim(0, 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("recall@K")
        ax.set_title(f"recall per layer, prompt {plen}")
        if ax.lines:
            ax.legend(fontsize=7)
    m = rep["model"]
    fig.suptitle(f"{m['id']} on {rep['hardware']['device_name']}, link {rep['link']['measured_gbps']:.3g} GB/s, "
                 f"cache {rep['cache']['slots']} experts", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _guard_curve(axes, rows: list[dict], plen: int) -> None:
    """Bytes vs quality: each exact arm and its guarded arms as one line, τ written at each point."""
    for base in dict.fromkeys(base_name(r["strategy"]) for r in rows):
        pts = [r for r in rows if base_name(r["strategy"]) == base]
        x = [r["h2d_bytes_per_token"] / 1e6 for r in pts]
        ys = ([r["quality"]["top1_agreement"] for r in pts],
              [(r.get("vs_exact") or {}).get("perplexity_ratio") or 1.0 for r in pts])
        for ax, y in zip(axes, ys):
            ax.plot(x, y, marker="o", label=base)
            for xi, yi, r in zip(x, y, pts):
                tau = r.get("fetch_threshold")
                ax.annotate("exact" if tau is None else f"τ={tau:g}", (xi, yi), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    for ax, name in zip(axes, ("top-1 agreement with exact", "perplexity / exact's")):
        ax.set_xlabel("H2D MB per token")
        ax.set_ylabel(name)
        ax.set_title(f"guarded vs exact, prompt {plen}: bytes vs {name.split()[0]}")
        ax.legend(fontsize=7)
