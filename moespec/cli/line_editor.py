"""How the chat REPL reads a line: prompt_toolkit on a terminal (as IPython does), plain lines from a pipe.

On a terminal, ``sys.stdin.readline()`` goes through the tty's canonical mode, which cuts a line at
4,095 bytes without a word and has no editing or history (the Up arrow sent ``^[[A`` to the model).
prompt_toolkit reads the keys itself in raw mode: no length limit, a bracketed paste arrives as one
message with its line breaks, arrows and Emacs keys edit, and the history is kept across sessions
in ``<moespec home>/chat_history``. Ctrl-C clears a typed line and stays at the prompt; at an empty
prompt it quits, as Ctrl-D does (README, "moespec chat").

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
