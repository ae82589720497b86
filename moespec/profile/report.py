"""The profile report: numbers per strategy aggregated from the runs, plus everything needed to
reproduce and compare them (versions, hardware, model, options, link, trace fingerprints).

Written atomically (a Ctrl-C or crash never leaves half a file) and refused when the path exists
unless ``force``. Per-token numbers are means over every decode step of every repeat; TTFT and
TPOT are mean ± sample std over repeats (a repeat's TPOT is the mean of its decode steps).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from moespec.config import OnMiss
from moespec.errors import DataError, OutputError
from moespec.fsutil import atomic_path
from moespec.gguf.layout import row_format as expert_format
from moespec.profile.guard_view import add_vs_exact
from moespec.profile.run import ProfileConfig, ProfileRun, RunRecord
from moespec.profile.schema import SCHEMA_VERSION, validate
from moespec.profile.strategy import MMAP, base_name
from moespec.runtime.stats import LayerStats


def _mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else 0.0,
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _experts_on(om) -> str:
    """Where the experts' rows live: "host" (RAM), "disk" (the store file read with O_DIRECT; on CPU the
    cache is the RAM tier) or "page cache" (the mmap baseline: the store file mapped)."""
    from moespec.runtime.host.disk_store import DiskStore

    if isinstance(om.store, DiskStore):
        return "disk"
    return "page cache" if getattr(om.store, "mapping", None) is not None else "host"


def describe(om, model_id: str) -> dict:
    """The "versions", "hardware", "model" and "cache" sections for ``om``."""
    import torch
    import transformers

    import moespec

    cfg_file = Path(om.path) / "config.json"
    config_hash = hashlib.sha256(cfg_file.read_bytes()).hexdigest()[:16] if cfg_file.exists() else ""
    text_cfg = om.config.get_text_config()
    dev = om.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "versions": {"moespec": moespec.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "hardware": {"device": str(dev), "device_name": name, "cpu": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count() or 0, "torch_threads": torch.get_num_threads()},
        "model": {"id": model_id, "config_hash": config_hash, "model_type": str(text_cfg.model_type),
                  "layers": int(text_cfg.num_hidden_layers), "moe_layers": len(om.store.moe_layers),
                  "experts": om.store.num_experts, "top_k": om.adapter.top_k(),
                  "hidden": om.store.layout.hidden, "expert_intermediate": om.store.layout.intermediate,
                  "expert_bytes": om.store.expert_bytes, "dtype": str(om.dtype).replace("torch.", ""),
                  "expert_format": expert_format(om.store.layout, om.dtype)},
        "cache": {"slots": om.cache.num_slots, "bytes": om.cache.num_slots * om.store.expert_bytes,
                  "experts_on": _experts_on(om)},
    }


def _strategy_result(runs: list[RunRecord], execute: str, expert_bytes: int, on_miss: str = "fetch",
                     threshold: float | None = None, moe_layers: int = 1, reads: str | None = None) -> dict:
    steps = [s for r in runs for s in r.steps]
    pre = [r for r in runs if getattr(r, "prefill", None) is not None]
    n = max(len(steps), 1)
    tot = LayerStats()
    per_layer: dict[int, LayerStats] = {}
    layer_ms: dict[int, float] = {}
    for s in steps:
        for layer, st in s.layers.items():
            tot.add(st)
            per_layer.setdefault(layer, LayerStats()).add(st)
        for layer, ms in s.layer_ms.items():
            layer_ms[layer] = layer_ms.get(layer, 0.0) + ms
    tpots = [statistics.fmean(st.wall_ms for st in r.steps) for r in runs if r.steps]
    copy_busy = sum(s.copy_busy_ms for s in steps)
    copy_bytes = sum(s.copy_bytes for s in steps)
    tpot = statistics.fmean(tpots) if tpots else 0.0
    nll = sum(s.nll for s in steps) / n
    on_demand = statistics.fmean(s.bounds.on_demand_ms for s in steps) if steps else 0.0
    floor = statistics.fmean(s.bounds.floor_ms for s in steps) if steps else 0.0
    copy_ms = statistics.fmean(s.bounds.copy_ms for s in steps) if steps else 0.0
    return {
        "strategy": runs[0].strategy,
        "upper_bound": base_name(runs[0].strategy) == "oracle",
        "prompt_len": runs[0].prompt_len,
        "execute": execute,
        "ttft_ms": _mean_std([r.ttft_ms for r in runs]),
        "tpot_ms": _mean_std(tpots),
        "tpot_runs_ms": tpots,  # one mean TPOT per repeat (min / median on a shared machine)
        "tokens_per_s": _mean_std([1e3 / t for t in tpots if t > 0]),
        "tpot_ratio_vs_none": None,  # filled in once every strategy is known
        "stall_ms_per_token": tot.stall_ms / n,
        "compute_ms_per_token": tot.compute_ms / n,
        "h2d_bytes_per_token": tot.h2d_bytes / n,
        "link_gbps_achieved": copy_bytes / copy_busy / 1e6 if copy_busy > 0 else None,
        "overlap_fraction": min(1.0, max(0.0, 1 - tot.stall_ms / copy_busy)) if copy_busy > 0 else None,
        "hit_rate": _ratio(tot.hits, tot.hits + tot.misses + tot.host_computed),
        "recall": _ratio(tot.recall_hits, tot.recall_total),
        "weighted_recall": _ratio(tot.weighted_hit, tot.weighted_total),
        "hits_per_token": tot.hits / n,
        "misses_per_token": tot.misses / n,
        "prefetched_per_token": tot.prefetched / n,
        "prefetch_wasted_per_token": tot.prefetch_wasted / n,
        "prefetch_cancelled_per_token": getattr(tot, "prefetch_cancelled", 0) / n,
        "skipped_per_token": tot.skipped / n,
        "on_miss": on_miss,
        "tpot_ratio_vs_fetch": None,  # filled in once every strategy is known
        "host": {"experts_per_token": tot.host_computed / n, "ms_per_token": tot.host_ms / n,
                 "d2h_bytes_per_token": tot.d2h_bytes / n, "h2d_bytes_per_token": tot.host_h2d_bytes / n,
                 # where the prefill's experts ran (per run): auto copies a chunk's expert when that wins
                 "prefill_fetched": statistics.fmean(r.prefill.misses for r in pre) if pre else 0.0,
                 "prefill_cached": statistics.fmean(r.prefill.hits for r in pre) if pre else 0.0,
                 "prefill_host": statistics.fmean(r.prefill.host_computed for r in pre) if pre else 0.0},
        "quality": {"top1_agreement": sum(s.top1 for s in steps) / n, "kl_mean": sum(s.kl for s in steps) / n,
                    "nll_mean": nll, "perplexity": math.exp(nll)},
        "fetch_threshold": threshold,
        # share of a token's top-K gate mass not run (guarded, speculative): summed over layers / per layer
        "skipped_mass_per_token": tot.skipped_mass / n,
        "skipped_mass_per_layer": tot.skipped_mass / n / max(moe_layers, 1),
        "substituted_per_token": tot.substituted / n,
        "vs_exact": None,  # guarded arms: filled in once the exact arm is known
        "bounds": {"on_demand_ms": on_demand, "floor_ms": floor,
                   "compute_ms": statistics.fmean(s.bounds.compute_ms for s in steps) if steps else 0.0,
                   "copy_ms": copy_ms, "copy_share": _ratio(copy_ms, on_demand),
                   "distance_ms": tpot - floor, "distance_ratio": _ratio(tpot, floor)},
        "totals": {"repeats": len(runs), "decode_tokens": len(steps), "hits": tot.hits, "misses": tot.misses,
                   "prefetched": tot.prefetched, "prefetch_used": tot.prefetch_used, "h2d_bytes": tot.h2d_bytes,
                   "copy_bytes": copy_bytes},
        "disk": _disk(steps, reads, copy_busy, n),
        "token_sha256": runs[0].token_sha256,
        "gate": getattr(runs[-1], "gate", None),  # per source layer: open, ran, skipped, saving/cost ms, why
        "per_layer": [{
            "layer": layer, "hits": st.hits / n, "misses": st.misses / n, "prefetched": st.prefetched / n,
            "prefetch_used": st.prefetch_used / n, "prefetch_wasted": st.prefetch_wasted / n,
            "h2d_bytes": st.h2d_bytes / n, "stall_ms": st.stall_ms / n, "compute_ms": st.compute_ms / n,
            "layer_ms": layer_ms.get(layer, 0.0) / n, "recall": _ratio(st.recall_hits, st.recall_total),
            "weighted_recall": _ratio(st.weighted_hit, st.weighted_total), "skipped": st.skipped / n,
            "host_computed": st.host_computed / n, "host_ms": st.host_ms / n, "d2h_bytes": st.d2h_bytes / n,
            "host_h2d_bytes": st.host_h2d_bytes / n, "skipped_mass": st.skipped_mass / n,
            "predicted": st.predicted / n, "predict_gated": st.predict_gated / n,
        } for layer, st in sorted(per_layer.items())],
    }


def _disk(steps, reads: str | None, copy_busy_ms: float, n: int) -> dict | None:
    """With the experts on disk: how the rows were read ("O_DIRECT" or "page cache", the mmap baseline),
    the bytes read from disk per decode token (/proc/self/io; the row copies' bytes where uncounted) and
    the disk GB/s while rows were being read (bytes / the copies' busy time); None off the disk tier."""
    if reads is None:
        return None
    counted = [s.disk_bytes for s in steps if s.disk_bytes is not None]
    nbytes = sum(counted) if counted else sum(s.copy_bytes for s in steps)
    return {"reads": reads, "counted": "/proc/self/io" if counted else "row copies",
            "bytes_per_token": nbytes / n, "gbps": nbytes / copy_busy_ms / 1e6 if copy_busy_ms > 0 and nbytes else None}


def build_report(description: dict, options: dict, cfg: ProfileConfig, prof: ProfileRun) -> dict:
    """The report dict (validates against schema.REPORT_SCHEMA)."""
    expert_bytes = description["model"]["expert_bytes"]
    on_disk = description["cache"].get("experts_on") == "disk"
    results = []
    for plen in cfg.prompt_lens:
        for strategy in cfg.strategies:
            runs = [r for r in prof.runs if r.prompt_len == plen and r.strategy == strategy.value]
            if runs:
                execute = getattr(strategy, "execute", None) or cfg.execute
                results.append(_strategy_result(runs, execute.value, expert_bytes,
                                                getattr(strategy, "on_miss", OnMiss.FETCH).value,
                                                getattr(strategy, "threshold", None),
                                                description["model"]["moe_layers"], _reads(strategy, on_disk)))
    for res in results:
        base = next((r for r in results if r["strategy"] == "none" and r["prompt_len"] == res["prompt_len"]), None)
        if base is not None:
            res["tpot_ratio_vs_none"] = _ratio(res["tpot_ms"]["mean"], base["tpot_ms"]["mean"])
        # The same predictor fetching its misses (router+host against router, router+host@0.1 against router@0.1).
        name, at, tau = res["strategy"].partition("@")
        plain = name.split("+")[0] + at + tau
        fetch = next((r for r in results if r["strategy"] == plain and r["prompt_len"] == res["prompt_len"]), None)
        if fetch is not None:
            res["tpot_ratio_vs_fetch"] = _ratio(res["tpot_ms"]["mean"], fetch["tpot_ms"]["mean"])
    add_vs_exact(results)
    link = prof.link
    if link.over == "disk":  # the experts on disk: the link is the store file's reader (transfer/disk.py)
        method = (f"disk reads ({'O_DIRECT' if link.o_direct else 'buffered'}) of the store file into the RAM "
                  f"tier, {link.copies} in flight")
    else:
        method = ("emulated link: worker-thread copies throttled to --link-gbps" if link.emulated_gbps else
                  "pinned host-to-device copies" if link.pinned else "host-to-device copies")
    first = next(iter(prof.traces.values()), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "moespec.profile",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **description,
        "options": options,
        "link": {"measured_gbps": link.gbps, "emulated_gbps": link.emulated_gbps, "pinned": link.pinned,
                 "over": link.over,
                 "method": f"{method}; {link.copies} copies of one expert ({link.bytes_per_copy} bytes)"},
        "trace": {"source": first.source if first else "", "gen": cfg.gen,
                  "prompts": [{"prompt_len": p, "token_sha256": t.sha256()} for p, t in prof.traces.items()]},
        "results": results,
        "copy_share": _copy_share(prof, results),
        "page_cache": prof.page_cache,
    }


def _reads(strategy, on_disk: bool) -> str | None:
    """How ``strategy`` read its rows with the experts on disk (None: they were in RAM)."""
    if not on_disk:
        return None
    return "page cache" if getattr(strategy, "reads", "direct") == MMAP else "O_DIRECT"


def _copy_share(prof: ProfileRun, results: list[dict]) -> dict | None:
    """``--copy-share``: what was asked, the probe, the link set and the share reached per prompt length
    (by the timed on-demand arm; None without one)."""
    share = prof.copy_share
    if share is None:
        return None
    reached = {str(r["prompt_len"]): share.reached(r["tpot_ms"]["mean"]) for r in results if r["strategy"] == "none"}
    return {"asked": share.asked, "probe_tpot_ms": share.probe_tpot_ms, "bytes_per_token": share.bytes_per_token,
            "link_gbps": share.link_gbps, "reached": reached}


def check_writable(path: str | os.PathLike | None, force: bool, flag: str = "--out") -> None:
    """Refuse an output path before any work is done: it exists (without ``force``) or its folder is not writable.

    Raises:
        OutputError: names the path and the flag.
    """
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{flag} {p} is a folder", f"give {flag} a file name")
    if p.exists() and not force:
        raise OutputError(f"{flag} {p} exists already", "pass --force to overwrite it, or choose another path")
    parent = next((q for q in [p.parent, *p.parent.parents] if q.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{flag} {p}: {parent} is not writable", f"choose a writable {flag} path")


def write_json(path: str | os.PathLike, obj: dict, force: bool) -> None:
    """Write ``obj`` as indented JSON atomically (NaN/Inf, which JSON lacks, written as null), sealed:
    its field ``xxh3`` is the XXH3-128 of the rest (integrity.seal_json), which :func:`load_report` checks."""
    from moespec.integrity import json_safe, seal_json

    with atomic_path(path, force=force) as tmp:
        tmp.write_text(json.dumps(seal_json(json_safe(obj)), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def load_report(path: str | os.PathLike) -> dict:
    """Read, verify and validate a saved report; returned without its ``xxh3`` seal.

    A report whose seal does not match its content (edited or damaged since `moespec profile` wrote
    it) is refused; one without a seal (written before reports were sealed, e.g. the committed
    examples in ``profiles/``) is read as before.

    Raises:
        DataError: unreadable, not JSON, its content changed since it was sealed, another schema
            version, or invalid (names the first problems).
    """
    from moespec.integrity import JSON_DIGEST_KEY, open_json

    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read a profile report ({exc})", "pass a file written by `moespec profile --out`") from None
    obj, intact = open_json(obj)
    if intact is False:
        raise DataError(f"{path}: the report changed after `moespec profile` wrote it (its {JSON_DIGEST_KEY} does not "
                        "match its content)", f"re-run `moespec profile --out`, or delete its {JSON_DIGEST_KEY} "
                        "field to read an edited report unchecked")
    if not isinstance(obj, dict) or obj.get("kind") != "moespec.profile":
        raise DataError(f"{path} is not a moespec profile report", "pass a file written by `moespec profile --out`")
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise DataError(f"{path} has schema_version {obj.get('schema_version')!r}; this moespec reads {SCHEMA_VERSION}",
                        "re-run `moespec profile` with this version")
    errs = validate(obj)
    if errs:
        raise DataError(f"{path} is not a valid profile report: {'; '.join(errs[:3])}")
    return obj
