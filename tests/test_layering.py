"""The package's layering is a checked contract: `lint-imports` keeps every contract in pyproject.toml,
and the floors contract really breaks on an upward import (a fixture package built from it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint(cwd: Path, pythonpath: Path, *config: str) -> subprocess.CompletedProcess:
    """`lint-imports` in ``cwd`` with only ``pythonpath`` on the path for the packages it checks."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, *config, "--no-cache", "--no-logo"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_lint_imports_keeps_every_contract():
    res = _lint(ROOT, ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in res.stdout


def _fixture(tmp_path: Path, upward: bool) -> Path:
    """A package ``fx`` with one module per floor of the floors contract, each importing the floor
    below it; ``upward``: `predict` also imports `runtime`, the floor above it."""
    floors = next(c for c in CONTRACTS if c["id"] == "floors")["layers"]
    names = [[n.strip().strip("()") for n in floor.split("|")] for floor in floors]
    pkg = tmp_path / "src" / "fx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for i, floor in enumerate(names):
        below = names[i + 1][0] if i + 1 < len(names) else None
        for name in floor:
            (pkg / f"{name}.py").write_text(f"import fx.{below}\n" if below else "")
    assert "runtime" in names[names.index(["predict", "hub"]) - 1]  # runtime is the floor above predict
    if upward:
        (pkg / "predict.py").write_text("import fx.models\nimport fx.runtime  # upward\n")
    layers = "\n".join(f"    {floor}" for floor in floors)
    config = tmp_path / "fx.ini"
    config.write_text(f"[importlinter]\nroot_package = fx\n\n[importlinter:contract:floors]\nname = floors\n"
                      f"type = layers\ncontainers =\n    fx\nlayers =\n{layers}\n")
    return config


@pytest.mark.parametrize("upward", [False, True])
def test_an_upward_import_breaks_the_floors(tmp_path, upward):
    config = _fixture(tmp_path, upward)
    res = _lint(tmp_path, tmp_path / "src", str(config))
    if not upward:
        assert res.returncode == 0, res.stdout + res.stderr
        return
    assert res.returncode != 0
    assert "fx.predict is not allowed to import fx.runtime" in res.stdout, res.stdout
    assert "Contracts: 0 kept, 1 broken." in res.stdout
