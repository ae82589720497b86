"""model_type -> adapter class, and the error for anything else."""

from __future__ import annotations

from moespec.errors import UnsupportedModelError
from moespec.models.base import MoeAdapter
from moespec.models.deepseek import DeepseekV2Adapter, DeepseekV3Adapter
from moespec.models.gpt_oss import GptOssAdapter
from moespec.models.mixtral import MixtralAdapter
from moespec.models.qwen2_moe import Qwen2MoeAdapter
from moespec.models.qwen_moe import OlmoeAdapter, Qwen3MoeAdapter

_ADAPTERS: tuple[type[MoeAdapter], ...] = (Qwen3MoeAdapter, Qwen2MoeAdapter, MixtralAdapter, OlmoeAdapter,
                                           GptOssAdapter, DeepseekV3Adapter, DeepseekV2Adapter)


def supported_model_types() -> list[str]:
    """The config.json `model_type` values moespec can run."""
    return sorted(t for a in _ADAPTERS for t in a.model_types)


def adapter_for(config) -> MoeAdapter:
    """The adapter for a transformers config.

    Raises:
        UnsupportedModelError: the model_type is not a supported MoE family (lists the supported ones).
    """
    model_type = getattr(config, "model_type", None)
    for cls in _ADAPTERS:
        if model_type in cls.model_types:
            return cls(config)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a Mixture-of-Experts family moespec supports",
        f"supported: {', '.join(supported_model_types())}",
    )
