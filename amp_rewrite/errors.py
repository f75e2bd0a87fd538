"""Exception hierarchy; each class carries the CLI exit code of docs/design.md §11."""
from __future__ import annotations


class AmpRewriteError(Exception):
    """Base class. ``exit_code`` is what the CLI returns for it."""

    exit_code = 1


class UsageError(AmpRewriteError):
    """Bad arguments or options (exit 2)."""

    exit_code = 2


class RuleFileError(UsageError):
    """A rule file or rule environment variable is malformed (exit 2)."""


class ModelError(AmpRewriteError):
    """The model is unreadable, invalid or unsupported (exit 3)."""

    exit_code = 3


class OutputCheckError(ModelError):
    """The rewritten model fails the full ONNX check (exit 3). The CLI then checks the input
    the same way: an input failing it is the model's problem, otherwise it is a bug."""


class CaptureError(ModelError):
    """A torch module could not be captured as a graph (exit 3)."""


class ValidationError(AmpRewriteError):
    """The rewritten model's outputs disagree with the FP32 model's (exit 4)."""

    exit_code = 4


class TrainingError(AmpRewriteError, RuntimeError):
    """Misuse of the training wrappers (loss scaler, optimizer wrapper).

    Also a ``RuntimeError``, so code written against ``torch.amp.GradScaler`` (which raises
    ``RuntimeError`` for the same misuse) keeps catching it.
    """


def first_line(error: BaseException) -> str:
    """The first line of an error's message (tool errors run to pages), else its type name."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def described(error: BaseException) -> str:
    """``Type: first line`` of an error, for one-line logs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
