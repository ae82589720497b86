"""Per-layer checkpoints of a default-model build, so an interrupted build resumes.

The build converts layer after layer; after each one it writes, atomically and in this order:
``layer-LL.safetensors`` (the converted MoE block's float32 tensors and the layer's report) and
``hidden.safetensors`` (the calibration hidden states after layer LL, in the working dtype, the
only input the next layer needs). A build stopped anywhere (Ctrl-C, power loss) restarts from the
layer after the one ``hidden.safetensors`` names; a layer file written after it is simply
redone. Each file carries a checksum of its data (moespec.integrity), verified before a build resumes
from it; damaged checkpoints are discarded like stale ones. ``state.json`` records the recipe digest: checkpoints of another recipe or source are
discarded, so a resumed build equals an uninterrupted one (the same inputs, in the same order).

Shapes: N calibration windows of S tokens, H hidden.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moespec.default_model.convert import LayerFits, LayerReport
from moespec.fsutil import atomic_path, atomic_write_text
from moespec.integrity import digest_metadata, nonfinite, open_json, safetensors_damage, seal_json, verify_digest

STATE_FILE = "state.json"
HIDDEN_FILE = "hidden.safetensors"


def _layer_file(index: int) -> str:
    return f"layer-{index:02d}.safetensors"


class LayerCheckpoints:
    """The finished layers of one build in ``folder`` (kept only while the build is unfinished).

    Args:
        folder: the build's state folder (models_dir() / ".NAME.partial").
        digest: recipe_digest() of this build; checkpoints of another digest are discarded.
    """

    def __init__(self, folder: Path, digest: str) -> None:
        self.folder = folder
        self.digest = digest

    def open(self) -> int:
        """Create or check the folder; returns the first layer still to convert (0: none done).

        Checkpoints of another recipe, or with a layer file missing, are removed first.

        Raises:
            OSError: the folder cannot be created or read.
        """
        try:
            state, intact = open_json(json.loads((self.folder / STATE_FILE).read_text(encoding="utf-8")))
            if intact is False:  # damaged: the checkpoints are made again, as for a missing state
                raise ValueError("state.json's checksum does not match its contents")
            done = self._hidden_after() + 1
            if state.get("digest") != self.digest or not all(
                    (self.folder / _layer_file(i)).is_file() for i in range(done)):
                raise ValueError("checkpoints of another recipe or incomplete")
            for name in [HIDDEN_FILE, *(_layer_file(i) for i in range(done))]:
                self._verified(name)  # read again when the build resumes: checked before any is used
            return done
        except (OSError, ValueError, KeyError, TypeError, SafetensorError):
            self.remove()
            self.folder.mkdir(parents=True)
            atomic_write_text(self.folder / STATE_FILE, json.dumps(seal_json({"digest": self.digest})) + "\n")
            return 0

    def _hidden_after(self) -> int:
        """The layer after which hidden.safetensors was taken; -1 without one."""
        path = self.folder / HIDDEN_FILE
        if not path.is_file():
            return -1
        with safe_open(str(path), framework="pt") as fh:
            return int(fh.metadata()["after_layer"])

    def save(self, index: int, block: dict[str, torch.Tensor], report: LayerReport, fits: LayerFits,
             hidden: torch.Tensor) -> None:
        """Record layer ``index`` as finished: its block tensors, report and fits, then ``hidden`` [N, S, H].

        Raises:
            OSError: a file cannot be written (disk full included); the previous checkpoint stays valid.
        """
        tensors = {name: t.detach().contiguous() for name, t in block.items()}
        tensors["fits.shared"], tensors["fits.experts"] = fits.shared.contiguous(), fits.experts.contiguous()
        with atomic_path(self.folder / _layer_file(index)) as tmp:
            save_file(tensors, str(tmp), metadata={"report": json.dumps(asdict(report)), **digest_metadata(tensors)})
        h = {"h": hidden.contiguous()}
        with atomic_path(self.folder / HIDDEN_FILE) as tmp:
            save_file(h, str(tmp), metadata={"after_layer": str(index), **digest_metadata(h)})

    def _verified(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of checkpoint file ``name``, checked against its checksum.

        Raises:
            ValueError: the file is truncated, or its data differs from its checksum (a resumed build
                must not start from damaged checkpoints: they are discarded and the build starts over).
        """
        path = self.folder / name
        damage = safetensors_damage(path)
        if damage is not None:
            raise ValueError(f"{path} is {damage}")
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            if verify_digest(fh.metadata(), tensors) is False or nonfinite(tensors):
                raise ValueError(f"{path} does not match its checksum or holds NaN/Inf")
        return tensors

    def hidden(self) -> torch.Tensor:
        """The hidden states after the last finished layer: [N, S, H] in the working dtype."""
        with safe_open(str(self.folder / HIDDEN_FILE), framework="pt") as fh:
            return fh.get_tensor("h")

    def layer(self, index: int) -> tuple[dict[str, torch.Tensor], LayerReport, LayerFits]:
        """Block tensors (float32, named as the block's state_dict), report and fits of layer ``index``."""
        with safe_open(str(self.folder / _layer_file(index)), framework="pt") as fh:
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
            report = LayerReport(**json.loads(fh.metadata()["report"]))
        fits = LayerFits(shared=tensors.pop("fits.shared"), experts=tensors.pop("fits.experts"),
                         router=tensors["gate.weight"], recall=report.recall)
        return tensors, report, fits

    def remove(self) -> None:
        """Delete the folder and everything in it (after a finished build, or stale checkpoints)."""
        shutil.rmtree(self.folder, ignore_errors=True)
