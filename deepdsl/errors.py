"""Errors the compiler reports to users as one line, with where in the network file they come from."""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SourceLocation:
    """A line in a user's network file."""

    filename: str
    lineno: int

    def __str__(self) -> str:
        name = self.filename
        if os.path.isabs(name):
            relative = os.path.relpath(name)
            name = name if relative.startswith("..") else relative
        return f"{name}:{self.lineno}"


class DeepDSLError(Exception):
    """Base class of every error reported to users as a single line (no traceback unless --debug)."""

    def __init__(self, message: str, location: SourceLocation | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class ShapeError(DeepDSLError):
    """A tensor's shape does not fit the layer it flows into."""


class NetworkFileError(DeepDSLError):
    """The network file cannot be loaded (syntax error, import error, missing Loop)."""


class VerifyError(DeepDSLError):
    """An SSA program breaks an invariant (define-before-use, single assignment, shapes, frees)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_location(skip_package: str = _PACKAGE_DIR) -> SourceLocation | None:
    """The innermost stack frame outside the deepdsl package: the network-file line being executed."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(skip_package + os.sep) and "importlib" not in filename:
            return SourceLocation(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def location_from_traceback(exc: BaseException, filename: str) -> SourceLocation | None:
    """The deepest line of `filename` in an exception's traceback."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(filename):
            found = SourceLocation(filename, frame.lineno or 0)
    return found
