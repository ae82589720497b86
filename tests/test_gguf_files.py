"""Finding GGUF models and refusing bad ones with one line that names the fix.

Split sets, folders, MODEL:QUANT, the Hub cache; the prepared folder reused on the second start;
unsupported and dense architectures, a missing split part, a truncated file, an expert type with
no dequantiser, --expert-dtype int4 on already quantised experts.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tiny_gguf import write_gguf

from moespec.config import RuntimeConfig
from moespec.errors import CheckpointError, ModelNotFoundError, OptionError, UnsupportedModelError
from moespec.gguf.export import ExportTypes
from moespec.hub.resolve import resolve_model
from moespec.runtime.load import load_offloaded

IDS = torch.tensor([[5, 17, 99, 3, 200, 41]])


def _logits(folder, **cfg) -> torch.Tensor:
    om = load_offloaded(folder, RuntimeConfig(dtype="float32", cache_experts=4, **cfg))
    try:
        with torch.inference_mode():
            return om.model(IDS).logits
    finally:
        om.close()


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """A tiny Qwen3-MoE GGUF with Q8_0 experts and its reference model."""
    return write_gguf(tmp_path_factory.mktemp("q8"), "qwen3_moe", ExportTypes("Q8_0"), hidden=64, inter=64)


def test_split_set_loads_from_any_part_and_a_missing_part_is_named(tmp_path, q8):
    first, ref = write_gguf(tmp_path / "split", "qwen3_moe", ExportTypes("Q8_0"), split_max_tensors=12, hidden=64, inter=64)
    parts = sorted(first.parent.glob("*-of-*.gguf"))
    assert len(parts) >= 3 and first.name.endswith("-00001-of-%05d.gguf" % len(parts))
    with torch.no_grad():
        want = ref(IDS).logits
    assert (_logits(resolve_model(str(parts[1]))) - want).abs().max() < 1e-5  # a later part names the whole set
    parts[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: {parts[1].name}"):
        resolve_model(str(first))


def test_folder_with_several_quants_needs_model_colon_quant(tmp_path, q8):
    path, _ = q8
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(path, folder / "Tiny-Q8_0.gguf")
    write_gguf(folder / "f32", "qwen3_moe", ExportTypes("F32"), name="Tiny-F32.gguf", hidden=64, inter=64)
    (folder / "mmproj-Tiny-F16.gguf").write_bytes(b"GGUF")  # a vision projector is never a candidate
    with pytest.raises(ModelNotFoundError, match="2 GGUF models: Tiny-F32.gguf \\(F32\\), Tiny-Q8_0.gguf \\(Q8_0\\)"):
        resolve_model(str(folder))
    chosen = resolve_model(f"{folder}:Q8_0")
    from moespec.artifacts import model_key

    assert model_key(chosen) == os.path.abspath(folder / "Tiny-Q8_0.gguf")


def test_hub_cache_repo_resolves_by_id_and_quant(tmp_path, monkeypatch, q8):
    path, _ = q8
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--Tiny-GGUF"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    shutil.copy(path, repo / "snapshots" / "abc123" / "Tiny-Q8_0.gguf")
    from moespec.artifacts import model_key

    assert model_key(resolve_model("org/Tiny-GGUF")) == "org/Tiny-GGUF:Q8_0"
    assert model_key(resolve_model("org/Tiny-GGUF:q8_0")) == "org/Tiny-GGUF:Q8_0"
    with pytest.raises(ModelNotFoundError, match="moespec download org/Other-GGUF --quant Q4_K_M"):
        resolve_model("org/Other-GGUF:Q4_K_M")


def test_second_start_reuses_the_prepared_folder_until_the_file_changes(tmp_path, q8, monkeypatch):
    from moespec.gguf import reader

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    opened = []
    real = reader.GgufCheckpoint.open
    monkeypatch.setattr(reader.GgufCheckpoint, "open", classmethod(lambda cls, f: opened.append(f) or real(f)))
    assert resolve_model(str(path)) == folder and opened == []  # neither metadata nor vocabulary read again
    os.utime(path, ns=(1, 1))
    assert resolve_model(str(path)) == folder and len(opened) == 1



def test_a_flipped_byte_in_the_prepared_folder_makes_it_again(tmp_path, q8, monkeypatch):
    """Every file of the folder (config, tokenizer, marker) is checked against the marker's digests."""
    from moespec.gguf import SOURCE_FILE, reader

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    good = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert SOURCE_FILE in good and "config.json" in good and "tokenizer.json" in good
    opened = []
    real = reader.GgufCheckpoint.open
    monkeypatch.setattr(reader.GgufCheckpoint, "open", classmethod(lambda cls, f: opened.append(f) or real(f)))
    for name, data in sorted(good.items()):
        damaged = bytearray(data)
        damaged[len(data) // 2] ^= 0x01  # a digit, a letter, a brace: JSON that may still parse
        (folder / name).write_bytes(bytes(damaged))
        opened.clear()
        assert resolve_model(str(path)) == folder and len(opened) == 1, name  # made again
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == good, name  # the same bytes as before

def test_a_damaged_marker_key_is_not_trusted_for_the_model_key(tmp_path, q8):
    """model_key reads the GGUF folder's key only when the marker matches its own digest; the next
    use of the GGUF makes the folder again, and the key is back."""
    from moespec.artifacts import model_key
    from moespec.gguf import SOURCE_FILE

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    marker = folder / SOURCE_FILE
    assert model_key(folder) == str(path)
    good = marker.read_text()
    assert good.count("m.gguf") >= 1
    marker.write_text(good.replace("m.gguf", "n.gguf"))  # valid JSON, a plausible key, a stale digest
    assert model_key(folder) == str(folder)  # not the damaged key: the folder's own path
    unsealed = {k: v for k, v in json.loads(good).items() if k != "digest"}
    marker.write_text(json.dumps(unsealed))  # an older marker without a digest: read as before
    assert model_key(folder) == str(path)
    marker.write_text(good.replace("m.gguf", "n.gguf"))
    assert resolve_model(str(path)) == folder and marker.read_text() == good and model_key(folder) == str(path)


def _write_raw(path, arch: str, experts: int) -> None:
    """A GGUF with an architecture's basic keys and one tensor (no tokenizer)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 32), (w.add_head_count, 4),
                   (w.add_feed_forward_length, 64), (w.add_context_length, 128)):
        add(v)
    if experts:
        w.add_expert_count(experts)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_and_dense_architectures(tmp_path):
    _write_raw(tmp_path / "g.gguf", "gemma3", 0)
    with pytest.raises(UnsupportedModelError, match="(?s)'gemma3'.*supported GGUF architectures: qwen3moe"):
        resolve_model(str(tmp_path / "g.gguf"))
    _write_raw(tmp_path / "d.gguf", "llama", 0)
    with pytest.raises(UnsupportedModelError, match="dense llama model"):
        resolve_model(str(tmp_path / "d.gguf"))


def test_truncated_file(tmp_path, q8):
    path = tmp_path / "cut.gguf"
    data = q8[0].read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        resolve_model(str(path))
    path.write_bytes(data[:100])  # the header itself is cut
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        resolve_model(str(path))


def test_expert_type_without_a_dequantiser_is_named(tmp_path):
    path, _ = write_gguf(tmp_path, "qwen3_moe", ExportTypes("TQ2_0"), hidden=256, inter=256, layers=1, experts=2)
    with pytest.raises(CheckpointError, match="stored as TQ2_0, which moespec cannot dequantise"):
        load_offloaded(resolve_model(str(path)), RuntimeConfig(dtype="float32"))


def test_int4_on_quantised_experts_says_so_unless_requantize(tmp_path, q8):
    folder = resolve_model(str(q8[0]))
    with pytest.raises(OptionError, match=r"(?s)already quantised \(Q8_0\).*--requantize"):
        load_offloaded(folder, RuntimeConfig(dtype="float32", expert_dtype="int4"))
    pytest.importorskip("torchao")
    with torch.no_grad():
        want = q8[1](IDS).logits
    got = _logits(folder, expert_dtype="int4", requantize=True)
    assert 0 < (got - want).abs().max() < 0.5  # quantised again: close, not equal
    f32, ref = write_gguf(tmp_path / "f32", "qwen3_moe", ExportTypes("F32"), hidden=64, inter=64)
    assert _logits(resolve_model(str(f32)), expert_dtype="int4").shape == want.shape  # float experts: quantised at load


def test_second_load_reads_the_dense_cache_instead_of_dequantising(tmp_path, q8, monkeypatch):
    from moespec.gguf import dense_cache
    from moespec.runtime.host import gguf_source as source

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    first = _logits(folder)
    cache = dense_cache.cache_file(folder, torch.float32)
    assert cache.is_file() and not list(folder.glob(".*.tmp"))
    calls = []
    real = source.GgufSource._dense
    monkeypatch.setattr(source.GgufSource, "_dense", lambda self, *a: calls.append(a) or real(self, *a))
    assert torch.equal(_logits(folder), first) and calls == []  # nothing dequantised
    good = cache.read_bytes()
    cache.write_bytes(good[:-8])  # a cut-off cache is ignored and rewritten
    assert torch.equal(_logits(folder), first) and calls and cache.read_bytes() == good


def test_a_flipped_byte_in_the_dense_cache_is_found_and_the_cache_made_again(tmp_path, q8, monkeypatch):
    """Data bytes (first, middle, last tensor byte) are caught by the per-tensor checksums as each
    tensor is read; header bytes (length, JSON, a checksum digit) by the byte-exact header."""
    from moespec.gguf import dense_cache
    from moespec.runtime.host import gguf_source as source

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    first = _logits(folder)
    cache = dense_cache.cache_file(folder, torch.float32)
    good = cache.read_bytes()
    head = 8 + int.from_bytes(good[:8], "little")
    meta = json.loads(json.loads(good[8:head])["__metadata__"][dense_cache.META_KEY])
    digit = good.index(min(meta["digests"].values()).encode()) + 5  # a digit of a checksum
    calls = []
    real = source.GgufSource._dense
    monkeypatch.setattr(source.GgufSource, "_dense", lambda self, *a: calls.append(a) or real(self, *a))
    for at in (0, 9, digit, head, (head + len(good)) // 2, len(good) - 1):
        damaged = bytearray(good)
        damaged[at] ^= 0x01
        cache.write_bytes(bytes(damaged))
        calls.clear()
        assert torch.equal(_logits(folder), first), at  # the damaged values never reach the model
        assert calls, at  # dequantised again
        assert cache.read_bytes() == good, at  # and cached again, byte-identical
        assert not list(folder.glob(".*.tmp")), at


def test_the_dense_cache_is_skipped_with_a_note_when_it_cannot_be_written(tmp_path, monkeypatch):
    """A disk too small for it: the writer says why in one line and leaves nothing; no exception."""
    from moespec import fsutil
    from moespec.gguf.dense_cache import DenseCacheWriter

    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 100)
    writer = DenseCacheWriter(tmp_path / "dense-float32.safetensors", [("w", torch.float32, (64, 64))],
                              torch.float32, [["m.gguf", 1, 2]])
    writer.write("w", torch.ones(64, 64))
    writer.finish()
    assert writer.note is not None and "disk full" in writer.note and len(writer.note) < 200
    assert list(tmp_path.iterdir()) == []


def test_a_dense_cache_that_cannot_be_written_is_a_note_of_the_load(tmp_path, q8, monkeypatch):
    from moespec import fsutil
    from moespec.gguf import dense_cache

    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    folder = resolve_model(str(path))
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 100)
    om = load_offloaded(folder, RuntimeConfig(dtype="float32", cache_experts=4))
    try:
        assert any("dense weights are not cached" in n for n in om.notes), om.notes
    finally:
        om.close()
    assert not dense_cache.cache_file(folder, torch.float32).exists() and not list(folder.glob(".*.tmp"))


def test_header_walk_equals_gguf_reader(q8):
    """reader._parse (the fast walk) reads what gguf's GGUFReader reads: metadata and tensor table."""
    from gguf import GGUFReader

    from moespec.gguf.reader import _parse

    fields, table, data_start = _parse(q8[0])
    ref = GGUFReader(q8[0])
    assert data_start == ref.data_offset
    assert [(t.name, t.ggml_type, t.offset, t.nbytes) for t in table] == \
        [(t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes)) for t in ref.tensors]
    assert [t.shape for t in table] == [tuple(reversed(t.shape.tolist())) for t in ref.tensors]
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert fields[key] == (value if not isinstance(value, list) or len(value) <= 256 else {"array_length": len(value)}), key


def test_a_prepare_killed_half_way_is_swept_by_the_next(tmp_path, q8, monkeypatch):
    """SIGKILL while the prepared folder is built: its locked temp folder is swept by the next prepare."""
    import signal
    import time

    from moespec import tempfiles
    from moespec.gguf import sidecar

    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "m.gguf"
    shutil.copy(q8[0], path)
    parent = sidecar.sidecar_dir("x").parent
    pid = os.fork()
    if pid == 0:  # the child: stops inside the build, to be killed
        try:
            sidecar._write_tokenizer = lambda files, folder: time.sleep(600)
            resolve_model(str(path))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    try:
        while not (temps := sorted(parent.glob(".*.tmp")) if parent.is_dir() else []) \
                or not (temps[0] / "config.json").is_file():
            assert time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0], "the temp never appeared"
            time.sleep(0.005)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert tempfiles.stale_temps(parent) == temps  # its lock died with it
    folder = resolve_model(str(path))
    assert (folder / "config.json").is_file() and not list(parent.glob(".*.tmp"))
