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


class SizeError(ShapeError):
    """A value, or a step's memory plan, larger than any machine holds (`deepdsl.ir.MAX_BYTES`)."""


class ArgumentError(DeepDSLError):
    """A layer, input, initializer or solver is given an argument it cannot take: of the wrong type, out of range, or
    a name the generated program cannot use."""


class NetworkFileError(DeepDSLError):
    """The network file cannot be loaded (syntax error, import error, missing Loop)."""


class VerifyError(DeepDSLError):
    """An SSA program breaks an invariant (define-before-use, single assignment, shapes, frees)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_location(skip_package: str = _PACKAGE_DIR) -> SourceLocation | None:
    """The innermost stack frame outside the deepdsl package: the network-file line being executed."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _is_compiler_frame(frame, skip_package):
            return SourceLocation(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def _is_compiler_frame(frame, package_dir: str) -> bool:
    """Whether a frame runs deepdsl itself: a module of the package, code the package generates when it is imported
    (a dataclass's `__init__`, compiled from `<string>` with its module's globals), or the import machinery that runs
    a network file."""
    filename = os.path.abspath(frame.f_code.co_filename)
    module = str(frame.f_globals.get("__name__", ""))
    return filename.startswith(package_dir + os.sep) or "importlib" in filename or \
        module == "deepdsl" or module.startswith("deepdsl.")


def location_from_traceback(exc: BaseException, filename: str) -> SourceLocation | None:
    """The deepest line of `filename` in an exception's traceback."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(filename):
            found = SourceLocation(filename, frame.lineno or 0)
    return found
