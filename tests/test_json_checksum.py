"""The JSON files moespec writes and reads back carry an XXH3-128 of the rest of their JSON.

One table-like test per file (eval per-arm results, the estimator-states manifest, the default
build's marker and its state.json): written sealed, read back intact; one character changed (a digit
into another digit, or a letter of the checksum itself) is found and treated like a truncated file
(refused with one line, or the build state made again); a file without the field (written before
it existed) is accepted.
"""

from __future__ import annotations

import json
import math

import pytest

from moespec.errors import DataError, OutputError
from moespec.integrity import JSON_DIGEST_KEY, json_digest, open_json, seal_json


def _change(path, old: str, new: str) -> None:
    """Replace the first ``old`` in the file by ``new`` (same length: a flipped character)."""
    text = path.read_text(encoding="utf-8")
    assert old in text and len(old) == len(new)
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _flip_checksum(path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    digest = data[JSON_DIGEST_KEY]
    _change(path, digest, digest[:-1] + ("0" if digest[-1] != "0" else "1"))


def test_the_seal_round_trips_through_json_text():
    obj = {"b": [1.0, 0.1, float("nan"), float("inf"), "é", None, True], "a": {"z": 1, "y": (2, 3)}}
    sealed = seal_json(obj)
    for text in (json.dumps(sealed), json.dumps(sealed, indent=1, sort_keys=True)):
        rest, intact = open_json(json.loads(text))
        assert intact is True and math.isnan(rest["b"][2]) and rest["a"]["y"] == [2, 3]
    assert seal_json(sealed) == sealed  # sealing twice changes nothing
    assert open_json({"a": 1}) == ({"a": 1}, None)  # older: no field
    assert open_json([1, 2]) == ([1, 2], None)
    assert open_json({**sealed, "a": {"z": 2, "y": [2, 3]}})[1] is False
    assert json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1})  # key order does not matter


def test_eval_arm_results(tmp_path):
    from moespec.eval.results import ArmResults

    path = tmp_path / "arm.json"
    key = {"model": "m", "arm": "a"}
    arm = ArmResults(path, key, {"t": {"sha256": "s", "items": {"0": {"acc": 0.25}}, "seconds": 1.5}})
    arm.save()
    assert JSON_DIGEST_KEY in json.loads(path.read_text())
    assert ArmResults.open(path, key).tasks["t"]["items"]["0"]["acc"] == 0.25
    good = path.read_text()
    _change(path, "0.25", "0.35")
    with pytest.raises(OutputError, match="checksum does not match") as exc:
        ArmResults.open(path, key)
    assert "\n" not in exc.value.message
    path.write_text(good)
    _flip_checksum(path)
    with pytest.raises(OutputError, match="checksum does not match"):
        ArmResults.open(path, key)
    older = json.loads(good)
    del older[JSON_DIGEST_KEY]
    path.write_text(json.dumps(older))
    assert ArmResults.open(path, key).tasks["t"]["items"]["0"]["acc"] == 0.25
    assert ArmResults.open(path, key, fresh=True).tasks == {}  # --fresh still starts it again


def test_estimator_states_manifest(tmp_path):
    from tiny_states import one_shard_states

    from moespec.estimator.states import MANIFEST, read_manifest, write_manifest

    folder = tmp_path / "states"
    man = one_shard_states(folder)
    write_manifest(folder, man)
    path = folder / MANIFEST
    assert read_manifest(folder) == man
    good = path.read_text()
    _change(path, '"tokens": 8', '"tokens": 9')
    with pytest.raises(DataError, match="checksum does not match") as exc:
        read_manifest(folder)
    assert "\n" not in exc.value.message and "--reuse-states" in exc.value.hint
    path.write_text(good)
    _flip_checksum(path)
    with pytest.raises(DataError, match="checksum does not match"):
        read_manifest(folder)
    older = json.loads(good)
    del older[JSON_DIGEST_KEY]
    path.write_text(json.dumps(older))
    assert read_manifest(folder) == man


def test_build_state_json(tmp_path):
    from moespec.default_model.checkpoints import STATE_FILE, LayerCheckpoints
    from writers import build_checkpoint

    folder = tmp_path / "state"
    folder.mkdir()
    LayerCheckpoints(folder, "digest").open()
    build_checkpoint(folder / "layer-00.safetensors")
    path = folder / STATE_FILE
    assert open_json(json.loads(path.read_text()))[1] is True
    assert LayerCheckpoints(folder, "digest").open() == 1
    _flip_checksum(path)
    assert LayerCheckpoints(folder, "digest").open() == 0  # damaged: made again, like a missing state
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    build_checkpoint(folder / "layer-00.safetensors")
    path.write_text(json.dumps({"digest": "digest"}) + "\n")  # older: no field, resumed
    assert LayerCheckpoints(folder, "digest").open() == 1


def test_default_build_marker(tmp_path):
    from moespec.default_model import build

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    marker = {"recipe_version": 1, "recipe_digest": build.recipe_digest(), "file_bytes": {"model.safetensors": 10},
              "build_s": 12.5}
    build.write_marker(folder, marker)
    path = folder / build.MARKER_FILE
    assert build.is_complete(folder) and build.build_marker(folder) == marker
    good = path.read_text()
    _change(path, "12.5", "13.5")
    assert build.build_marker(folder) is None and not build.is_complete(folder)  # damaged: built again
    path.write_text(good)
    _flip_checksum(path)
    assert not build.is_complete(folder)
    path.write_text(json.dumps(marker, indent=2) + "\n")  # a build made before the field: NOT rebuilt
    assert build.is_complete(folder)
