"""The chat REPL through a real pseudo-terminal (pexpect), not a pipe: prompt_toolkit's line editor.

A 100 KB bracketed paste arrives whole as one message (a tty in canonical mode cut lines at 4,095
bytes), Ctrl-C clears a typed line and quits only at an empty prompt, the history survives the
session, and bytes that are not UTF-8 get one line instead of reaching the model.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

HERE = Path(__file__).parent
UP = "\x1b[A"
PROMPT = r"\x1b\[0;1m>"  # prompt_toolkit draws the bold "> " as ">" and a cursor move
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


def _env(home: Path) -> dict:
    return dict(os.environ, MOESPEC_HOME=str(home), TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1",
                PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
                COLUMNS="80", LINES="24")


def _reader(tmp_path: Path):
    return pexpect.spawn(sys.executable, [str(HERE / "pty_reader.py"), str(tmp_path / "history")],
                         env=_env(tmp_path), encoding="utf-8", codec_errors="replace", timeout=60,
                         dimensions=(24, 80))


def _got(child, text: str) -> None:
    """The reader got exactly ``text``; waits for the next prompt (keys sent between two prompts meet
    the tty in canonical mode, where Ctrl-D and Ctrl-C are not keys)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    child.expect(r"GOT (\d+) ([0-9a-f]+)")
    assert (int(child.match.group(1)), child.match.group(2)) == (len(text), digest)
    child.expect(PROMPT)


def test_a_100kb_bracketed_paste_arrives_whole_as_one_message(tmp_path):
    paste = "\n".join(f"line {i}: " + "x" * 90 for i in range(1000))  # 100 KB, 1000 lines
    child = _reader(tmp_path)
    child.expect(PROMPT)
    child.send(PASTE_START + paste + PASTE_END)
    child.send("\r")
    _got(child, paste)
    child.sendcontrol("d")
    child.expect_exact("EOF")


def test_ctrl_c_clears_a_typed_line_and_quits_at_an_empty_prompt(tmp_path):
    child = _reader(tmp_path)
    child.expect(PROMPT)
    child.send("typed but not sent")
    child.sendcontrol("c")
    child.send("second\r")
    _got(child, "second")  # the first line was cleared, not sent and not kept in front
    child.sendcontrol("c")
    child.expect_exact("EOF")
    child.expect(pexpect.EOF)


def test_history_survives_the_session(tmp_path):
    child = _reader(tmp_path)
    child.expect(PROMPT)
    child.send("what is 2+2?\r")
    _got(child, "what is 2+2?")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    again = _reader(tmp_path)  # a new session: the Up arrow brings the last question back
    again.expect(PROMPT)
    again.send(UP + "\r")
    _got(again, "what is 2+2?")
    again.sendcontrol("d")
    again.expect(pexpect.EOF)


def test_bytes_that_are_not_utf8_are_found(tmp_path):
    child = _reader(tmp_path)
    child.expect(PROMPT)
    os.write(child.child_fd, b"caf\xe9\r")  # a Latin-1 é: not UTF-8 (raw bytes, past the encoder)
    child.expect(r"BAD 0x([0-9a-f]+)|GOT")
    assert child.match.group(1) == "e9"
    child.expect(PROMPT)
    assert "Exception" not in child.before and "Press ENTER" not in child.before  # the history took it quietly
    child.sendcontrol("d")
    child.expect_exact("EOF")


def test_chat_repl_in_a_terminal(tmp_path, tiny_models):
    """The whole REPL on a tiny model: a non-UTF-8 line is one error and never reaches the model,
    Ctrl-C at a typed line keeps the conversation, /exit quits with 0."""
    child = pexpect.spawn(sys.executable, ["-m", "moespec", "chat", str(tiny_models["qwen2_moe"]), "--max-new-tokens",
                                           "3", "--cache-experts", "6"],
                          env=_env(tmp_path), encoding="utf-8", codec_errors="replace", timeout=120,
                          dimensions=(24, 200))
    child.expect_exact("lists the commands")
    child.expect(PROMPT)
    child.send("hello\r")
    child.expect("TPOT")
    child.expect(PROMPT)
    os.write(child.child_fd, b"\xe9t\xe9\r")  # Latin-1, not UTF-8
    child.expect("not valid UTF-8 \\(byte 0x[0-9a-f]+\\); nothing was sent")
    assert "Press ENTER" not in child.before and "Traceback" not in child.before
    child.expect(PROMPT)
    child.send("half a question")
    child.sendcontrol("c")  # clears the line; the conversation stays
    child.send("/stats\r")
    child.expect("last answer: \\d+ decode tokens")
    child.expect(PROMPT)
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert child.before.count("TPOT") == 0  # nothing after the first answer was sent to the model
    history = (tmp_path / "chat_history").read_text()
    assert "+hello" in history and "+/stats" in history and "half a question" not in history


def test_a_damaged_history_is_set_aside_with_one_note_and_the_session_starts_empty(tmp_path):
    history = tmp_path / "history"
    history.write_bytes(b"\n# 2026-12-01\n+what is 2+2?\n\xff\xfe garbage \x00\n+tail")
    child = _reader(tmp_path)
    child.expect(r"NOTE (.*)\r\n")
    note = child.match.group(1)
    assert "damaged (line 4 is not UTF-8)" in note and "empty history" in note
    child.expect(PROMPT)
    child.send(UP + "\r")  # nothing to bring back
    _got(child, "")
    child.send("hello\r")
    _got(child, "hello")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    assert (tmp_path / "history.damaged").read_bytes().startswith(b"\n# 2026-12-01")
    again = _reader(tmp_path)  # the new history is whole: no note, the Up arrow brings "hello" back
    i = again.expect([r"NOTE", PROMPT])
    assert i == 1
    again.send(UP + "\r")
    _got(again, "hello")
    again.sendcontrol("d")
    again.expect(pexpect.EOF)


def test_history_damage_accepts_what_filehistory_writes_and_names_each_fault(tmp_path):
    from prompt_toolkit.history import FileHistory

    from moespec.cli.line_editor import history_damage, set_aside

    path = tmp_path / "h"
    assert history_damage(path) is None  # absent: a first session
    for text in ("one", "two\nlines", "", "+plus # hash", "\x00 nul", "é"):
        FileHistory(str(path)).store_string(text)
    assert history_damage(path) is None
    good = path.read_bytes()
    for damaged, why in [(good + b"\xc3", "is not UTF-8"), (good + b"stray text\n", "neither an entry nor"),
                         (b"+ok\n\x80\n", "line 2 is not UTF-8")]:
        path.write_bytes(damaged)
        assert why in history_damage(path)
    folder = tmp_path / "d"
    folder.mkdir()
    assert history_damage(folder) == "it is not a file"
    (tmp_path / "d.damaged").mkdir()  # cannot be replaced: the history stays in memory
    freed, note = set_aside(folder, "it is not a file")
    assert freed is None and "in memory only" in note and folder.is_dir()
