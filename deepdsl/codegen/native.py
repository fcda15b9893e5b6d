"""Code generation of the compiled CPU kernels: `<program>.c` and its library `<program>.<digest>.so`.

`render_c(description)` renders `codegen_templates/kernels.c.jinja` from the `ProgramDescription` the Python
program is rendered from: for each elementwise kernel of the program, one function per operand pattern its
statements call it with, the expression printed as float32 C by the same printer as the CUDA kernels (what it shares
with the runtime's generic kernels: `#include "cpu_common.h"`). `build_library(c)` (the runtime's,
`deepdsl_runtime.cpu.native`, which a program's first run calls too) compiles it with the C compiler (`cc`, or $CC)
and OpenMP into the library `deepdsl_runtime.cpu.native.load` looks for (its name's digest covers the sources, the
flags and the processor), after the generic kernels' library that all programs share where that is missing
(`deepdsl_cpu.<digest>.so` in ~/.cache/deepdsl); it returns None, and says why, where there is no compiler or the
build fails: the program then runs its numpy kernels.

    python -m deepdsl.codegen.native build generated/lenet.c      # (re)build one program's library
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sympy

from deepdsl_runtime import contract
# the build is the runtime's (a program builds its own library on its first run): one build command, one place
from deepdsl_runtime.cpu.native import (NO_COMPILER, build_library, compile_command, find_compiler, generic_library,
                                        library_path)

__all__ = ["render_c", "build_library", "build_in_background", "find_compiler", "compile_command", "not_built"]


def render_c(description, program: str | None = None) -> str:
    """The text of the `.c` file of a `ProgramDescription`; `program`: the program's file name as the header names
    it (default: the description's)."""
    from deepdsl.codegen import render
    from deepdsl.codegen.cuda import c_expression

    patterns, sums, many = (dict(description.kernel_patterns), dict(description.kernel_sums),
                            dict(description.kernel_many))
    kernels = [{"name": k.name, "text": sympy.sstr(k.expr), "c": c_expression(k.expr), "inputs": list(range(k.arity)),
                "patterns": patterns.get(k.name, ()), "sums": sums.get(k.name, ()), "many": many.get(k.name, ())}
               for k in description.kernels]
    by_name = {k["name"]: k for k in kernels}
    pairs = [{"function": contract.pair_function(*pair), "first": by_name[pair[0]], "first_pattern": pair[1],
              "second": by_name[pair[2]], "second_pattern": pair[3], "summed": pair[4]}
             for pair in description.kernel_pairs]
    return render("kernels.c.jinja", name=description.name, program=program or description.filename,
                  version=description.version, source=description.source,
                  structure_hash=description.structure_hash, kernels=kernels, pairs=pairs)


def not_built(why: str) -> str:
    """What `deepdsl compile` and `deepdsl run` say when the library is not built."""
    return f"compiled CPU kernels not built ({why}): the program runs numpy's"


def build_in_background(source) -> str:
    """Start building the library of `source` in a process of its own and return at once (what it will write);
    the program waits for a build in progress when it starts (`deepdsl_runtime.cpu.native.load`)."""
    source = Path(source)
    target = library_path(source)
    if target.exists() and generic_library(source).exists():
        return f"{target} is current"
    if find_compiler() is None:
        return not_built(NO_COMPILER)
    root = str(Path(__file__).resolve().parents[2])        # a source checkout's root (harmless when installed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-m", "deepdsl.codegen.native", "build", str(source)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    # claim the build under the child's name before returning: a program started after this sees it in progress
    target.with_name(f".{target.name}.{child.pid}.tmp").touch()
    return f"building {target.name} in the background"


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "build":
        print("usage: python -m deepdsl.codegen.native build PROGRAM.c", file=sys.stderr)
        return 2
    built, why = build_library(argv[1])
    print(f"wrote {built}" if built else f"not built: {why}")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
