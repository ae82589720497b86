"""Opening a model for generation: resolve MODEL, load it offloaded, attach stats, tokenizer.

The steps of chat's ``_open_session`` as one reusable function (``moespec serve`` uses it), so
every face over the engine opens a model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moespec.config import RuntimeConfig


@dataclass(frozen=True)
class OpenedModel:
    """A loaded model ready to generate.

    Attributes:
        engine: the token-id Engine (its ``om`` records per-step stats in a StatsRecorder).
        tokenizer: the checkpoint's transformers tokenizer.
        path: the checkpoint folder.
    """

    engine: object
    tokenizer: object
    path: Path

    def describe(self, cfg: RuntimeConfig) -> str:
        """One line: layers, experts, slots, device, predictor (for a start-up message)."""
        from moespec.gguf.layout import row_format as expert_format

        om = self.engine.om
        return (f"{self.path.name}: {len(om.store.moe_layers)} MoE layers × {om.store.num_experts} experts "
                f"(top-{om.adapter.top_k()}), {om.cache.num_slots} cache slots of "
                f"{om.store.expert_bytes / 1e6:.2f} MB ({expert_format(om.store.layout, om.dtype)}) on "
                f"{om.device}; predictor {cfg.predictor.value}, execute {cfg.execute.value}, "
                f"cache policy {om.cache.policy.value}"
                + (f", dense linears {cfg.dense_dtype}" if cfg.dense_dtype not in (None, "auto") else ""))

    def close(self) -> None:
        """Stop the runtime's background work."""
        self.engine.om.close()


def open_model(model: Optional[str], cfg: RuntimeConfig, console=None) -> OpenedModel:
    """Load ``model`` (a folder or Hub id; None = the embedded default model) for generation.

    ``console`` (rich) shows the default model's first-use build; None stays quiet.

    Raises:
        ModelNotFoundError, CheckpointError, UnsupportedModelError, BudgetError, DeviceError,
        OptionError: from resolving and loading the checkpoint.
    """
    from moespec.hub.resolve import resolve_model
    from moespec.model_check import load_tokenizer
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded
    from moespec.runtime.stats import StatsRecorder

    if model is None:
        try:
            from moespec.default_model import ensure_default_model
        except ImportError:
            from moespec.errors import ModelNotFoundError

            raise ModelNotFoundError("this build has no embedded default model",
                                     "pass MODEL: a local folder or a Hub id (`moespec download MODEL`)") from None
        path = ensure_default_model(console)
        from moespec.default_model.verify import start_check

        check = start_check(path)  # hashes the weights on a second thread while they load
    else:
        path = resolve_model(model)
    tokenizer = load_tokenizer(path, cfg.dtype)  # a broken config or tokenizer: said before the weights load
    om = load_offloaded(path, cfg, StatsRecorder())  # wires the recorder's synchronize to the engine
    if model is None:
        try:
            check.result()  # before the first token: a mismatch removes the marker, one line
        except BaseException:
            om.close()
            raise
        if check.note and console is not None:
            console.print(f"[dim]{check.note}[/]")
    return OpenedModel(Engine(om), tokenizer, Path(path))
