"""The recipe's recorded layer fits (neuron splits and routers), shipped with moespec.

Splitting the neurons, finding the oracle experts and fitting the routers are deterministic
functions of the calibration states and take about 40% of a layer's conversion. Their results
are small (about 1.2 MB for 30 layers), so the full recipe's results are shipped in
``recipe_fits.safetensors`` beside this file, stamped with the recipe digest of the code that
produced them (recipe.recipe_digest). A user's build uses them only when that digest equals its
own; then it refits only the down projections, on calibration states that flow through the same
converted layers, so it builds the model the full recipe builds (tested: the full recipe on
layer 0 reproduces the recorded fits of layer 0). Otherwise (the code changed and nobody
recorded new fits) the build runs the full recipe: slower, never wrong.
``python scripts/default_model_gates.py --full --record`` records new fits.

Shapes: E routed experts, I_e neurons per expert, H hidden.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moespec.default_model.convert import LayerFits
from moespec.fsutil import atomic_path

FITS_FILE = "recipe_fits.safetensors"


def fits_path() -> Path:
    """Where the recorded fits live in the installed package."""
    return Path(str(resources.files(__package__).joinpath(FITS_FILE)))


def recorded_fits(digest: str, n_layers: int) -> list[LayerFits] | None:
    """The recorded fits of every layer when they were made by the recipe of ``digest``, else None.

    Args:
        digest: recipe.recipe_digest() of the running code.
        n_layers: layers of the model (a file for another depth is not used).

    Returns:
        One :class:`LayerFits` per layer (indices int64, router [E, H] float32), or None.
    """
    path = fits_path()
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads(fh.metadata()["fits"])
            if meta["recipe_digest"] != digest or meta["n_layers"] != n_layers:
                return None
            return [LayerFits(shared=fh.get_tensor(f"shared.{i}").long(), experts=fh.get_tensor(f"experts.{i}").long(),
                              router=fh.get_tensor(f"router.{i}"), recall=float(meta["recall"][i]))
                    for i in range(n_layers)]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_fits(path: Path, fits: list[LayerFits], digest: str) -> None:
    """Write ``fits`` (one per layer) stamped with ``digest``: indices as int16, routers float32.

    Raises:
        OSError: the file cannot be written.
    """
    tensors = {}
    for i, f in enumerate(fits):
        tensors[f"shared.{i}"] = f.shared.to(torch.int16).contiguous()
        tensors[f"experts.{i}"] = f.experts.to(torch.int16).contiguous()
        tensors[f"router.{i}"] = f.router.to(torch.float32).contiguous()
    meta = {"recipe_digest": digest, "n_layers": len(fits), "recall": [f.recall for f in fits]}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"fits": json.dumps(meta)})
