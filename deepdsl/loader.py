"""Load a network file: run it as a Python module and return the `Loop` it defines.

Any failure is turned into a one-line `DeepDSLError` naming the file and line: syntax errors, import errors, shape
errors raised by layers, any other exception raised while the file runs (`sys.exit` and a `BaseException` subclass of
the file's own included; a KeyboardInterrupt stops the command), a path that is no regular file (a loop of symbolic
links, a FIFO), and two tensors of one name in the Loop.
"""
from __future__ import annotations

import contextvars
import importlib.util
import itertools
import os
import sys

from deepdsl import dsl, provenance
from deepdsl.dsl import Loop, Overrides
from deepdsl.errors import DeepDSLError, NetworkFileError, SourceLocation, location_from_traceback

_module_ids = itertools.count()


def load(path: str, overrides: Overrides | None = None) -> Loop:
    """The Loop defined by the network file at `path` (its variable `loop`, or its only Loop)."""
    if os.path.isdir(path):
        raise NetworkFileError(f"{path}: is a directory, not a network file")
    if not os.path.isfile(path):
        try:
            os.stat(path)
            why = "not a regular file"            # a FIFO or a device: reading it could wait for ever
        except FileNotFoundError:
            why = "no such network file"
        except OSError as err:                    # a loop of symbolic links, a directory not searchable
            why = f"cannot read: {err.strerror}"
        raise NetworkFileError(f"{path}: {why}")
    ctx = contextvars.copy_context()
    return ctx.run(_load, path, overrides or Overrides())


def _load(path: str, overrides: Overrides) -> Loop:
    dsl._overrides.set(overrides)
    dsl._dropout_keys.set(None)
    dsl._leaf_makers.set({})
    provenance.begin()
    name = f"deepdsl_network_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        source = open(path, encoding="utf-8").read()
        code = compile(source, path, "exec")
    except SyntaxError as err:
        raise NetworkFileError(f"syntax error: {err.msg}", SourceLocation(path, err.lineno or 0)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise NetworkFileError(f"{path}: cannot read: {err}") from None
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except DeepDSLError:
        raise
    except SystemExit as err:
        raise NetworkFileError(f"the network file called sys.exit({err.code!r}); a network file must run to its end",
                               location_from_traceback(err, path)) from None
    except ImportError as err:
        raise NetworkFileError(f"import error: {err}", location_from_traceback(err, path)) from None
    except KeyboardInterrupt:             # an interrupt (Ctrl-C) stops the command, as it does anywhere
        raise
    except BaseException as err:   # noqa: BLE001 -- any error in user code (a BaseException subclass of its own
        # included) becomes one line naming its place
        raise NetworkFileError(f"{type(err).__name__}: {err}", location_from_traceback(err, path)) from None
    finally:
        sys.modules.pop(name, None)
    loops = [v for v in module.__dict__.values() if isinstance(v, Loop)]
    loop = module.__dict__.get("loop")
    if not isinstance(loop, Loop):
        if len(loops) != 1:
            raise NetworkFileError(f"{path}: defines {'no' if not loops else 'several'} D.Loop; "
                                   "name the one to compile `loop`")
        loop = loops[0]
    dsl.check_names(loop)
    loop.source = path
    loop.overrides = overrides
    return loop
