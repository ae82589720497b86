"""Reads lines with the REPL's line editor and reports each one: ``GOT <chars> <sha256 of UTF-8>``
(first ``NOTE <line>`` when the history file was damaged and set aside).

Run in a pseudo-terminal by tests/test_repl_terminal.py: ``python tests/pty_reader.py HISTORY_FILE``.
"""

import hashlib
import sys
from pathlib import Path

from moespec.cli.line_editor import TerminalReader, undecodable

reader = TerminalReader(Path(sys.argv[1]))
if reader.note:
    print(f"NOTE {reader.note}", flush=True)
while True:
    line = reader.read()
    if line is None:
        print("EOF", flush=True)
        break
    bad = undecodable(line)
    if bad is not None:
        print(f"BAD 0x{bad:02x}", flush=True)
        continue
    print(f"GOT {len(line)} {hashlib.sha256(line.encode()).hexdigest()[:16]}", flush=True)
