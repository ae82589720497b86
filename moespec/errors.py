"""Typed errors a user can cause.

The library raises these; the CLI turns them into one message and a non-zero exit code
(`MOESPEC_DEBUG=1` shows the traceback). Each carries a hint naming the flag or command that
fixes it.
"""

from __future__ import annotations


class MoespecError(Exception):
    """Base class of every error a user can cause.

    Args:
        message: what is wrong, naming the offending value.
        hint: how to fix it (the flag or command to use), or "".
    """

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message


class ModelNotFoundError(MoespecError):
    """The model folder or Hub id cannot be resolved locally."""


class CheckpointError(MoespecError):
    """A checkpoint is missing files, truncated, corrupt or has unexpected tensors."""


class UnsupportedModelError(MoespecError):
    """The architecture is not a Mixture-of-Experts model moespec supports."""


class BudgetError(MoespecError):
    """The device expert budget is too small for the model's top-k."""


class DeviceError(MoespecError):
    """The requested device is not available."""


class PromptError(MoespecError):
    """The prompt is empty or longer than the model's context."""


class OptionError(MoespecError):
    """An option has an invalid value."""


class CalibrationError(MoespecError):
    """A calibration or estimator file is missing, corrupt or made for another model."""


class DataError(MoespecError):
    """Input data (text, jsonl) is missing, empty or unreadable."""


class OutputError(MoespecError):
    """An output path is not writable or exists already."""


class HubAccessError(MoespecError):
    """The repo exists but this token may not read it (gated, private, or the token is invalid)."""


class HubUnreachableError(MoespecError):
    """The Hub endpoint cannot be reached (network down, offline mode, server error)."""


class ChatTemplateError(MoespecError):
    """The model's chat template failed to render the conversation (a Jinja error or a refusal)."""
