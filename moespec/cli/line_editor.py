"""How the chat REPL reads a line: prompt_toolkit on a terminal (as IPython does), plain lines from a pipe.

On a terminal, ``sys.stdin.readline()`` goes through the tty's canonical mode, which cuts a line at
4,095 bytes without a word and has no editing or history (the Up arrow sent ``^[[A`` to the model).
prompt_toolkit reads the keys itself in raw mode: no length limit, a bracketed paste arrives as one
message with its line breaks, arrows and Emacs keys edit, and the history is kept across sessions
in ``<moespec home>/chat_history``. Ctrl-C clears a typed line and stays at the prompt; at an empty
prompt it quits, as Ctrl-D does (README, "moespec chat"). The history file is checked before use
(:func:`history_damage`: UTF-8, every line an entry ``+...``, a timestamp ``#...`` or empty, as
prompt_toolkit's FileHistory writes it); a damaged one is moved aside to ``chat_history.damaged``
and the REPL starts with an empty history, with one note line (:attr:`TerminalReader.note`).

From a pipe (scripted input, tests) lines are read as before, as bytes decoded as UTF-8; bytes
that are not UTF-8 become lone surrogates here as on the terminal, and :func:`undecodable` finds
them so the REPL can say so in one line instead of sending them to the model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HISTORY_FILE = "chat_history"
PROMPT = "> "
_SURROGATE = re.compile("[\udc80-\udcff]")


def history_path() -> Path:
    """Where the REPL's history lives: ``<moespec home>/chat_history``."""
    from moespec.paths import moespec_home

    return moespec_home() / HISTORY_FILE


def history_damage(path: Path) -> str | None:
    """Why ``path`` is not a history file as prompt_toolkit's FileHistory writes it ("line 3 is not
    UTF-8"), or None when it is (or does not exist). Reads the file once, line by line."""
    if not path.exists():
        return None
    if not path.is_file():
        return "it is not a file"
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    return f"line {number} is not UTF-8"
                if line.rstrip("\r\n") and line[0] not in "+#":
                    return f"line {number} is neither an entry nor a timestamp"
    except OSError as exc:
        return f"it cannot be read: {exc.strerror or exc}"
    return None


def set_aside(path: Path, why: str) -> tuple[Path | None, str]:
    """Move the damaged history ``path`` to ``NAME.damaged`` (replacing an older one): (``path``, now
    free for a new history, or None when it could not be moved: this session's history stays in
    memory), and the one-line note saying so."""
    from moespec.paths import display_path

    aside = path.with_name(path.name + ".damaged")
    try:
        if aside.is_dir() and not aside.is_symlink():
            raise IsADirectoryError(f"{aside} is a folder")
        path.replace(aside)
    except OSError:
        return None, (f"the chat history {display_path(path)} is damaged ({why}) and cannot be moved aside; "
                      "this session's history is kept in memory only")
    return path, (f"the chat history {display_path(path)} was damaged ({why}); kept as {aside.name}, "
                  "starting with an empty history")


def undecodable(line: str) -> int | None:
    """The first byte of ``line`` that was not UTF-8 (decoded with surrogateescape), or None."""
    m = _SURROGATE.search(line)
    return None if m is None else ord(m.group()) - 0xDC00


class PipeReader:
    """Lines from a non-terminal stdin (``echo hi | moespec chat``, scripted tests).

    Args:
        out: a rich Console the prompt is printed on (as before the line editor existed).
    """

    def __init__(self, out) -> None:
        self.out = out
        self.note: str | None = None  # (a pipe keeps no history)

    def read(self) -> str | None:
        """One line without its newline; None at end of input. Ctrl-C raises KeyboardInterrupt."""
        self.out.print(f"[bold]{PROMPT.strip()}[/] ", end="")
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text-only stdin (some embedders): already decoded
            line = sys.stdin.readline()
        else:
            raw = stream.readline()
            line = raw.decode("utf-8", errors="surrogateescape")
        return line.rstrip("\r\n") if line else None


class TerminalReader:
    """Lines edited with prompt_toolkit on a terminal, with history across sessions.

    Args:
        history: the history file (None: this session only, e.g. when moespec's home is read-only).

    Attributes:
        note: one line for the user when the history file was damaged (set aside), else None.
    """

    def __init__(self, history: Path | None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("c-c")
        def _interrupt(event) -> None:
            buffer = event.app.current_buffer
            if buffer.text:  # a typed line: clear it, stay at the prompt (as a shell does)
                buffer.reset()
            else:  # an empty prompt: quit
                event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

        class DecodableHistory(FileHistory):
            """FileHistory that skips a line that is not UTF-8 (its encoder would raise inside the prompt)."""

            def store_string(self, string: str) -> None:
                if undecodable(string) is None:
                    super().store_string(string)

        self.note: str | None = None
        why = None if history is None else history_damage(history)
        if why is not None:
            history, self.note = set_aside(history, why)
        store = InMemoryHistory()
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                history.touch(exist_ok=True)
                store = DecodableHistory(str(history))
            except OSError:
                pass  # a read-only home: history for this session only
        self.session = PromptSession(history=store, key_bindings=bindings)

    def read(self) -> str | None:
        """One line (a bracketed paste may hold several, as one message); None at Ctrl-D or Ctrl-C at an
        empty prompt."""
        from prompt_toolkit.formatted_text import FormattedText

        try:
            return self.session.prompt(FormattedText([("bold", PROMPT)]))
        except (EOFError, KeyboardInterrupt):
            return None


def line_reader(out):
    """The reader for this process: TerminalReader when stdin and stdout are terminals, else PipeReader."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        return TerminalReader(history_path())
    return PipeReader(out)
