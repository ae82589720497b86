"""The profile report's JSON schema (draft 2020-12) and a small validator for the subset it uses.

The validator checks type, required, properties, additionalProperties (False), items, enum,
const and minimum, which is all the schema uses, so reading a report needs no extra package.
Bump SCHEMA_VERSION whenever a field changes meaning or disappears.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_MEAN_STD = {"type": "object", "required": ["mean", "std"], "additionalProperties": False,
             "properties": {"mean": _NUM, "std": {"type": "number", "minimum": 0}}}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "required": required if required is not None else list(props),
            "properties": props}


_PER_LAYER = _obj({
    "layer": _INT, "hits": _NUM, "misses": _NUM, "prefetched": _NUM, "prefetch_used": _NUM,
    "prefetch_wasted": _NUM, "h2d_bytes": _NUM, "stall_ms": _NUM, "compute_ms": _NUM, "layer_ms": _NUM,
    "recall": _NUM_OR_NULL, "weighted_recall": _NUM_OR_NULL, "skipped": _NUM,
    "host_computed": _NUM, "host_ms": _NUM, "d2h_bytes": _NUM, "host_h2d_bytes": _NUM, "skipped_mass": _NUM,
    # decode visits per token at which the layer predicted the next one / the prediction gate skipped it
    "predicted": _NUM, "predict_gated": _NUM,
}, required=["layer", "hits", "misses", "prefetched", "prefetch_used", "prefetch_wasted", "h2d_bytes", "stall_ms",
             "compute_ms", "layer_ms", "recall", "weighted_recall", "skipped"])

_RESULT = _obj({
    "strategy": _STR,  # a predictor, or PREDICTOR+ONMISS (profile/strategy.py)
    "upper_bound": {"type": "boolean"},
    "prompt_len": _INT,
    "execute": _STR,
    "ttft_ms": _MEAN_STD,
    "tpot_ms": _MEAN_STD,
    "tokens_per_s": _MEAN_STD,
    "tpot_ratio_vs_none": _NUM_OR_NULL,
    "stall_ms_per_token": _NUM,
    "compute_ms_per_token": _NUM,
    "h2d_bytes_per_token": _NUM,
    "link_gbps_achieved": _NUM_OR_NULL,
    "overlap_fraction": _NUM_OR_NULL,
    "hit_rate": _NUM_OR_NULL,
    "recall": _NUM_OR_NULL,
    "weighted_recall": _NUM_OR_NULL,
    "hits_per_token": _NUM,
    "misses_per_token": _NUM,
    "prefetched_per_token": _NUM,
    "prefetch_wasted_per_token": _NUM,
    "prefetch_cancelled_per_token": _NUM,
    "skipped_per_token": _NUM,
    "on_miss": {"type": "string", "enum": ["fetch", "host", "auto"]},
    "tpot_ratio_vs_fetch": _NUM_OR_NULL,
    "tpot_runs_ms": {"type": "array", "items": _NUM},
    "host": _obj({"experts_per_token": _NUM, "ms_per_token": _NUM, "d2h_bytes_per_token": _NUM,
                  "h2d_bytes_per_token": _NUM, "prefill_fetched": _NUM, "prefill_cached": _NUM,
                  "prefill_host": _NUM}),
    "quality": _obj({"top1_agreement": _NUM, "kl_mean": _NUM, "nll_mean": _NUM, "perplexity": _NUM},
                    required=["top1_agreement", "kl_mean"]),  # nll/perplexity came with guarded arms
    "fetch_threshold": _NUM_OR_NULL,  # τ of a guarded arm (NAME@τ); None for the others
    "skipped_mass_per_token": _NUM,
    "skipped_mass_per_layer": _NUM,
    "substituted_per_token": _NUM,
    "vs_exact": {"type": ["object", "null"], "properties": {
        "h2d_ratio": _NUM_OR_NULL, "bytes_saved": _NUM_OR_NULL, "perplexity_ratio": _NUM_OR_NULL}},
    "bounds": _obj({"on_demand_ms": _NUM, "floor_ms": _NUM, "compute_ms": _NUM, "copy_ms": _NUM,
                    "copy_share": _NUM_OR_NULL, "distance_ms": _NUM, "distance_ratio": _NUM_OR_NULL}),
    "totals": _obj({"repeats": _INT, "decode_tokens": _INT, "hits": _INT, "misses": _INT, "prefetched": _INT,
                    "prefetch_used": _INT, "h2d_bytes": _INT, "copy_bytes": _INT}),
    # the experts on disk: how rows were read, disk bytes per token, GB/s while reading (report._disk)
    "disk": {"type": ["object", "null"], "properties": {
        "reads": {"type": "string", "enum": ["O_DIRECT", "page cache"]}, "counted": _STR,
        "bytes_per_token": _NUM, "gbps": _NUM_OR_NULL}},
    "token_sha256": _STR,
    "per_layer": {"type": "array", "items": _PER_LAYER},
    "gate": {"type": ["array", "null"]},  # the prediction gate per source layer (runtime/layer/gate.py)
})
# Reports written before --on-miss have none of these: optional, so they still load.
_RESULT["required"] = [k for k in _RESULT["required"] if k not in ("on_miss", "tpot_ratio_vs_fetch", "host",
                                                                           "tpot_runs_ms", "fetch_threshold",
                                                                           "skipped_mass_per_token",
                                                                           "skipped_mass_per_layer",
                                                                           "substituted_per_token", "vs_exact", "gate",
                                                                           "disk")]

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "moespec profile report",
    **_obj({
        "schema_version": {"const": SCHEMA_VERSION},
        "kind": {"const": "moespec.profile"},
        "created": _STR,
        "versions": _obj({"moespec": _STR, "torch": _STR, "transformers": _STR, "python": _STR}),
        "hardware": _obj({"device": _STR, "device_name": _STR, "cpu": _STR, "cpu_count": _INT,
                          "torch_threads": _INT}),
        "model": _obj({"id": _STR, "config_hash": _STR, "model_type": _STR, "layers": _INT, "moe_layers": _INT,
                       "experts": _INT, "top_k": _INT, "hidden": _INT, "expert_intermediate": _INT,
                       "expert_bytes": _INT, "dtype": _STR, "expert_format": _STR},
                      # expert_format (int4-g64, mxfp4, float32...) came later: older reports lack it
                      required=["id", "config_hash", "model_type", "layers", "moe_layers", "experts", "top_k",
                                "hidden", "expert_intermediate", "expert_bytes", "dtype"]),
        "options": {"type": "object"},
        "cache": _obj({"slots": _INT, "bytes": _INT}),
        "link": _obj({"measured_gbps": _NUM, "emulated_gbps": _NUM_OR_NULL, "pinned": {"type": "boolean"},
                      "method": _STR}),
        "trace": _obj({"source": _STR, "gen": _INT, "prompts": {"type": "array", "items": _obj(
            {"prompt_len": _INT, "token_sha256": _STR})}}),
        "results": {"type": "array", "items": _RESULT},
        "policy_hit_rates": {"type": "object"},  # optional: prompt length -> policy -> hit rates
        # optional (--copy-share): asked, probe_tpot_ms, bytes_per_token, link_gbps, reached (prompt len -> share)
        "copy_share": {"type": ["object", "null"]},
        # optional (experts on disk): before each run "dropped" (the page cache, as root) or "store file"
        # (only the store file's pages: not root); null otherwise
        "page_cache": {"type": ["string", "null"], "enum": ["dropped", "store file", None]},
        # optional: the XXH3-128 of the rest (integrity.seal_json); older reports lack it
        "xxh3": _STR,
    }, required=["schema_version", "kind", "created", "versions", "hardware", "model", "options", "cache", "link",
                 "trace", "results"]),
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def validate(value, schema: dict = REPORT_SCHEMA, where: str = "$") -> list[str]:
    """Problems of ``value`` against ``schema`` as "path: what" strings (empty = valid)."""
    errs: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "const" in schema and value != schema["const"]:
        errs.append(f"{where}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        errs.append(f"{where}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errs.append(f"{where}: missing {key!r}")
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key in value:
                errs.extend(validate(value[key], sub, f"{where}.{key}"))
        if schema.get("additionalProperties") is False:
            errs.extend(f"{where}: unexpected {k!r}" for k in value if k not in props)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errs.extend(validate(item, schema["items"], f"{where}[{i}]"))
    return errs
