"""Every numeric option of every command, against the one range table (cli/ranges.py), through
Typer's CliRunner: NaN, ±inf, 0, negative, huge, the bounds and one past them, and a wrong type.

A value outside its range is one error line naming the flag, the value and the range, and nothing
else ran (MODEL is a folder that does not exist, so a value let through says so instead).
"""

from __future__ import annotations

import math

import pytest
import typer.main
from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.cli.ranges import COMMAND_OPTIONS, OPTIONS, range_of

runner = CliRunner()
MISSING = "/nonexistent/moespec-model"
# what a command needs besides the option so that it gets as far as MODEL
EXTRA = {"chat": ["--prompt", "hi"], "download": [], "models": [], "serve": []}
TEXT_OPTIONS = {"--gpu-memory", "--host-memory", "--fetch-threshold", "--prompt-len", "--layers"}


def _numeric_options():
    group = typer.main.get_command(app)
    out = []
    for name, cmd in sorted(group.commands.items()):
        for param in cmd.params:
            flags = [o for o in getattr(param, "opts", []) if o.startswith("--")]
            kind = _kind(getattr(getattr(param, "type_descriptor", None), "annotation", None))
            if flags and (kind in ("integer", "float") or flags[0] in TEXT_OPTIONS):
                out.append((name, flags[0], kind or "text"))
    return out


def _kind(annotation) -> str:
    """"integer", "float" or "" for an option's annotation (Optional[int] is int)."""
    import typing

    types = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return {int: "integer", float: "float"}.get(types[0], "")


NUMERIC = _numeric_options()


def test_the_table_covers_every_numeric_option_and_nothing_else():
    missing = [(c, f) for c, f, _ in NUMERIC if range_of(c, f) is None]
    assert missing == []
    used = {f for _, f, _ in NUMERIC}
    assert set(OPTIONS) == used and {f for _, f in COMMAND_OPTIONS} <= used
    assert len(NUMERIC) >= 60  # 7 commands; serve's flags included


def _values(spec, kind: str) -> list[str]:
    """NaN, ±inf, 0, negative, huge, a wrong type, both bounds and one step past each."""
    hi = spec.upper()
    values = ["nan", "inf", "-inf", "0", "-1", "abc"]
    if spec.kind is int:
        values += ["1" + "0" * 30, str(spec.low), str(hi), str(hi + 1)]
    else:
        values += ["1e30", repr(float(spec.low)), repr(float(hi)), repr(float(hi) * 1.01 + 1e-9)]
    return list(dict.fromkeys(values))


def _accepted(spec, text: str, kind: str) -> bool | None:
    """Whether the table lets ``text`` through (None: the text is not even of the option's type)."""
    try:
        value = int(text) if kind == "integer" else float(text)
    except ValueError:
        return None
    if kind == "text":
        value = int(value) if spec.kind is int and math.isfinite(value) and float(value).is_integer() else value
    return spec.contains(value)


@pytest.mark.parametrize("command,flag,kind", NUMERIC, ids=[f"{c}{f}" for c, f, _ in NUMERIC])
def test_every_bad_value_is_one_line_naming_the_flag_and_its_range(command, flag, kind, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # `download` must not reach out for a value let through
    spec = range_of(command, flag)
    model = [] if command == "models" else [MISSING]
    for text in _values(spec, kind):
        r = runner.invoke(app, [command, *model, flag, text, *EXTRA.get(command, [])])
        assert "Traceback" not in r.output, (flag, text, r.output)
        ok = _accepted(spec, text, kind)
        lines = [x for x in r.output.splitlines() if x.startswith("error:")]
        if ok:
            assert not any(line.startswith(f"error: {flag}") for line in lines), (flag, text, r.output)
            continue
        assert r.exit_code == 2, (flag, text, r.output)
        (line,) = lines
        assert line.startswith(f"error: {flag}"), (flag, text, line)
        if ok is False or kind != "text":
            assert "must be" in line or "is not" in line, (flag, text, line)
        assert MISSING not in r.output  # refused before MODEL was even looked at


def test_host_threads_is_capped_by_the_cores(monkeypatch):
    import moespec.cli.ranges as ranges

    monkeypatch.setattr(ranges, "usable_cores", lambda: 2)
    r = runner.invoke(app, ["chat", MISSING, "--host-threads", "10000", "--prompt", "hi"])
    assert r.exit_code == 2
    assert "--host-threads 10000 must be at least 1 and at most 2 (the cores this process may use)" in r.output


def test_the_messages_of_the_issue(monkeypatch):
    cases = {("chat", "--link-gbps", "nan"): "--link-gbps nan must be a finite number > 0 and <= 10000",
             ("chat", "--group-size", "0"): "--group-size 0 must be at least 1",
             ("train-estimator", "--link-gbps", "0"): None,  # 0 ignores the estimator's cost there
             ("chat", "--threads", "abc"): "--threads: input should be a valid integer"}
    for (command, flag, text), needle in cases.items():
        r = runner.invoke(app, [command, MISSING, flag, text, *EXTRA.get(command, [])])
        if needle is None:
            assert f"error: {flag}" not in r.output
        else:
            assert needle in r.output and r.exit_code == 2
