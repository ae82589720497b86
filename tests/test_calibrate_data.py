"""Calibration text: reading .txt / folders / .jsonl, clear errors for bad data, chunk planning."""

from __future__ import annotations

import json

import pytest

from moespec.calibrate.data import builtin_source, load_text_source, plan_chunks
from moespec.errors import DataError, OptionError


class _CharTokenizer:
    """One token per character; EOS 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [ord(c) % 250 + 1 for c in text]}


def test_txt_folder_and_jsonl_are_read(tmp_path):
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    sub = tmp_path / "d"
    sub.mkdir()
    (sub / "x.txt").write_text("one", encoding="utf-8")
    (sub / "y.txt").write_text("two", encoding="utf-8")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": "b"}) + "\n", encoding="utf-8")
    assert load_text_source(tmp_path / "a.txt").documents == ("hello",)
    assert sorted(load_text_source(sub).documents) == ["one", "two"]
    assert sorted(load_text_source(tmp_path / "t.jsonl").documents) == ["a", "b"]
    assert load_text_source(sub, seed=1).documents == load_text_source(sub, seed=1).documents


def test_builtin_text_has_a_heldout_part():
    src = builtin_source()
    assert len(src.documents[0]) > 100_000 and src.heldout and "public domain" in src.description


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", b"", "holds no text"),
    ("blank.txt", b"  \n\n ", "holds no text"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), "not UTF-8"),
    ("bad.jsonl", b"{not json}\n", "line 1 is not JSON"),
    ("notext.jsonl", b'{"content": "x"}\n', "no string \"text\" field"),
])
def test_bad_data_names_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as exc:
        load_text_source(path)
    assert name in str(exc.value)


def test_missing_path_and_folder_without_txt(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_text_source(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="no .txt files"):
        load_text_source(tmp_path)


def test_fewer_tokens_than_one_chunk_is_an_error(tmp_path):
    (tmp_path / "s.txt").write_text("short", encoding="utf-8")
    with pytest.raises(DataError, match="fewer than two chunks of --seq-len 8"):
        plan_chunks(_CharTokenizer(), load_text_source(tmp_path / "s.txt"), 100, None, 8)


def test_more_tokens_than_the_data_holds_uses_what_there_is(tmp_path):
    (tmp_path / "s.txt").write_text("x" * 100, encoding="utf-8")
    plan = plan_chunks(_CharTokenizer(), load_text_source(tmp_path / "s.txt"), 1000, None, 16)
    assert plan.calib_tokens + plan.heldout_tokens == 100
    assert plan.heldout_tokens == 16 and plan.calib_tokens == 84
    assert "fewer than --tokens 1000" in plan.notes[0]


def test_chunks_cover_exactly_the_tokens_asked(tmp_path):
    (tmp_path / "s.txt").write_text("y" * 1000, encoding="utf-8")
    plan = plan_chunks(_CharTokenizer(), load_text_source(tmp_path / "s.txt"), 100, 40, 32)
    assert [len(c) for c in plan.calib] == [32, 32, 32, 4]
    assert [len(c) for c in plan.heldout] == [32, 8]
    assert not plan.notes


def test_bad_numbers_are_option_errors(tmp_path):
    (tmp_path / "s.txt").write_text("y" * 1000, encoding="utf-8")
    src = load_text_source(tmp_path / "s.txt")
    for tokens, held, seq, flag in ((0, None, 8, "--tokens"), (10, 0, 8, "--heldout-tokens"), (10, None, 1, "--seq-len")):
        with pytest.raises(OptionError, match=flag):
            plan_chunks(_CharTokenizer(), src, tokens, held, seq)
