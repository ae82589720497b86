"""Shared fixtures: tiny checkpoints of every family, built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_checkpoint  # noqa: E402

from moespec.paths import moespec_home  # noqa: E402

# Why: the user's moespec home, read at import, before the session fixture below points
# MOESPEC_HOME at a temp folder: the default-model fixture reuses the model `moespec chat` built.
USER_MOESPEC_HOME = moespec_home()

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]

# Why: on 2 cores, 2 intra-op threads plus the copy worker thread oversubscribe the CPU and make
# tiny forwards ~100x slower; results do not depend on the thread count.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    """moespec's cache goes to a temporary folder unless a test says otherwise.

    Session-scoped: module- and session-scoped fixtures (a profile run, a quantised or disk store)
    run before any function-scoped fixture, so a per-test home let them write into the user's.
    """
    with pytest.MonkeyPatch.context() as mp:
        if "MOESPEC_HOME" not in os.environ or os.environ.get("CI"):
            mp.setenv("MOESPEC_HOME", str(tmp_path_factory.getbasetemp() / "moespec_home"))
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a tiny random checkpoint (3 layers, 8 experts, top-2, H=32, I=16)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_checkpoint(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


def pytest_collection_modifyitems(config, items):
    """Skip `cuda`-marked tests cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


ADAPTER_FAMILIES = ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


@pytest.fixture(scope="session")
def adapter_models(tmp_path_factory) -> dict[str, Path]:
    """GPT-OSS (dense and MXFP4 experts), DeepSeek-V2/V3 and GLM-4.7-Flash tiny checkpoints (3 layers, 8 experts)."""
    from tiny import make_mxfp4_checkpoint

    root = tmp_path_factory.mktemp("adapters")
    out = {f: make_checkpoint(root / f, f, seed=10 + i) for i, f in enumerate(ADAPTER_FAMILIES) if f != "gpt_oss_mxfp4"}
    out["gpt_oss_mxfp4"] = make_mxfp4_checkpoint(root / "gpt_oss_mxfp4", seed=20)
    return out


@pytest.fixture(scope="module")
def default_model(pytestconfig, tmp_path_factory):
    """(slow tests) The embedded default model's folder in the user's moespec home (CI: the session's temp folder),
    reused when its recipe digest is this code's, else built once with its progress bars shown.

    The user's home is read at import (USER_MOESPEC_HOME), before the session fixture points
    MOESPEC_HOME at a temp folder, so the README's test command reuses (or leaves behind) the
    model `moespec chat` uses.
    """
    import io
    import os
    import shutil

    from rich.console import Console

    from moespec.default_model import build, ensure_default_model, source
    home = tmp_path_factory.getbasetemp() / "moespec_home" if os.environ.get("CI") else USER_MOESPEC_HOME
    mp = pytest.MonkeyPatch()
    mp.setenv("MOESPEC_HOME", str(home))
    cached = Path.home() / ".cache" / "moespec" / "wheels" / source.WHEEL_FILENAME
    if cached.is_file() and not (home / "wheels" / source.WHEEL_FILENAME).exists():
        (home / "wheels").mkdir(parents=True, exist_ok=True)
        shutil.copy(cached, home / "wheels" / source.WHEEL_FILENAME)
    if build.is_complete(build.default_model_dir()):
        folder = ensure_default_model(Console(file=io.StringIO()))
    else:  # a real build: show its progress bars instead of capturing them
        with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            folder = ensure_default_model(Console(stderr=True))
    yield folder
    mp.undo()
