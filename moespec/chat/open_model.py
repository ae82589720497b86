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
    from moespec.default_model.checked import load_checked, resolve
    from moespec.default_model.verify import check_for
    from moespec.model_check import load_tokenizer
    from moespec.runtime.engine import Engine
    from moespec.runtime.stats import StatsRecorder

    path = resolve(model, console)  # None or the default model named: built (again) when needed
    check = check_for(path)  # a default-model build: its weights are hashed on a second thread from now
    try:
        tokenizer = load_tokenizer(path, cfg.dtype)  # a broken config or tokenizer: said before the weights load
    except BaseException:
        if check is not None:
            check.join()
        raise
    om, note = load_checked(path, cfg, StatsRecorder(), check)  # joined before the first token: one line
    if note and console is not None:
        console.print(f"[dim]{note}[/]")
    return OpenedModel(Engine(om), tokenizer, Path(path))
