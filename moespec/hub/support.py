"""Which checkpoint architectures moespec can run, stated once.

The adapters issue extends ``SUPPORTED_MODEL_TYPES`` when a family gets its adapter under
``moespec/models``; the download command and model resolution read it from here.
"""

from __future__ import annotations

from typing import Any, Mapping

from moespec.errors import UnsupportedModelError

# config.json "model_type" -> the family name users know.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen1.5/Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE (e.g. Qwen3-30B-A3B)",
    "olmoe": "OLMoE",
    "gpt_oss": "GPT-OSS (gpt-oss-20b, gpt-oss-120b)",
    "deepseek_v2": "DeepSeek-V2 (e.g. DeepSeek-V2-Lite)",
    "deepseek_v3": "DeepSeek-V3",
    "glm4_moe_lite": "GLM-4.7-Flash",
}


def supported_list() -> str:
    """The supported model types as one line, e.g. ``mixtral, olmoe, qwen2_moe, qwen3_moe``."""
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def check_supported(config: Mapping[str, Any], model: str, force: bool = False) -> str:
    """Return the config's ``model_type`` if moespec can run it.

    Args:
        config: the parsed config.json of the checkpoint.
        model: the Hub id or folder, named in the message.
        force: accept any model_type (the caller warns).

    Raises:
        UnsupportedModelError: model_type missing or not in :data:`SUPPORTED_MODEL_TYPES`
            (the message lists the supported ones; the hint names ``--force``).
    """
    model_type = str(config.get("model_type") or "")
    if force or model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    what = f"model_type {model_type!r}" if model_type else "no model_type in config.json"
    raise UnsupportedModelError(
        f"{model} has {what}; moespec runs these Mixture-of-Experts families: {supported_list()}",
        "pass --force to download it anyway (moespec will not be able to run it yet)",
    )
