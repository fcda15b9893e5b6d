"""CUDA code generation: the kernels a generated program runs with `--device cuda`.

`render_cuda(description)` renders `codegen_templates/kernels.cu.jinja` into the text of `<program>.cu` from the
`ProgramDescription` the Python program is rendered from (`generate_cuda(compiled)` describes and renders): the
program's elementwise kernels (`ew1`, `ew2`, ... -- the same functions, in the same order, as the numpy kernels of
`<program>.py`), each printed from its sympy expression as float32 C by `CudaPrinter`, after `#include "ops.cu"`,
the runtime's generic kernels. `write_cuda(description, program_path)` writes it next to the program and, when nvcc
is installed, builds the fat binary `<program>.<digest>.fatbin` (SASS for sm_80 and sm_90 plus PTX for later GPUs)
the runtime loads without compiling; the digest names the exact sources (`deepdsl_runtime.cuda.layout.kernel_sources_digest`), so a binary
from other sources is never loaded, and fat binaries are build products (not checked in: .gitignore).

    python -m deepdsl.codegen.cuda build generated/lenet.cu     # (re)build one program's fat binary
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import sympy
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE

import deepdsl_runtime
from deepdsl_runtime.cuda.layout import kernel_sources_digest

__all__ = ["CudaPrinter", "ARCHS", "c_expression", "generate_cuda", "render_cuda", "write_cuda", "build_fatbin",
           "find_nvcc", "kernels_dir", "nvcc_command", "sources_digest"]

ARCHS = (80, 90)           # SASS in the fat binary; PTX of the last for newer GPUs


class CudaPrinter(C99CodePrinter):
    """sympy's C99 printer in float32 (`expf`, `0.5F`), with the functions our expressions use spelled the way the
    numpy backend computes them: Heaviside(x, 0) as (x > 0 ? 1 : 0), the ReLU derivative PyTorch uses; small integer
    powers as products (numpy's square); x**(-1/2) as 1/sqrtf(x); sign as (x > 0) - (x < 0); Max and Min as
    numpy's maximum and minimum (NaN wins: `deepdsl_maxf`, runtime/kernels/deepdsl_math.h); Sigmoid and Softplus by
    the forms of deepdsl_math.h that do not overflow; exp and erf as `deepdsl_expf` and `deepdsl_erff` (the
    device's expf and erff on the GPU, polynomial forms on the CPU, whose loops vectorize)."""

    def __init__(self, settings=None):
        from sympy.codegen.ast import float32, real

        # no math.h macros (M_SQRT2, M_PI): they are double constants, which would make the kernel compute in double
        super().__init__({"type_aliases": {real: float32}, "math_macros": {},
                          "user_functions": {"Sigmoid": "deepdsl_sigmoidf", "Softplus": "deepdsl_softplusf",
                                             "erf": "deepdsl_erff", "exp": "deepdsl_expf"},
                          **(settings or {})})

    def _print_NumberSymbol(self, expr):
        return self._print(sympy.Float(expr.evalf(20), 20))

    _print_Pi = _print_Exp1 = _print_EulerGamma = _print_GoldenRatio = _print_Catalan = _print_NumberSymbol

    def _print_Heaviside(self, expr):
        x = self._print(expr.args[0])
        at_zero = expr.args[1] if len(expr.args) > 1 else sympy.Rational(1, 2)
        if at_zero == 0:
            return f"(({x}) > 0.0F ? 1.0F : 0.0F)"
        if at_zero == 1:
            return f"(({x}) >= 0.0F ? 1.0F : 0.0F)"
        return f"(({x}) > 0.0F ? 1.0F : (({x}) < 0.0F ? 0.0F : {self._print(sympy.Float(at_zero))}))"

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        return f"((float)(({x}) > 0.0F) - (float)(({x}) < 0.0F))"

    def _print_Max(self, expr):
        return self._fold("deepdsl_maxf", expr)

    def _print_Min(self, expr):
        return self._fold("deepdsl_minf", expr)

    def _fold(self, name, expr):
        """name(name(a, b), c) ... over the operands in the order numpy's kernel applies them."""
        from deepdsl.codegen.ufuncs import ordered_operands

        args = ordered_operands(list(expr.args))
        code = self._print(args[0])
        for a in args[1:]:
            code = f"{name}({code}, {self._print(a)})"
        return code

    def _print_Pow(self, expr):
        base, exp = expr.args
        if exp.is_Integer and 2 <= int(exp) <= 4:
            b = self.parenthesize(base, PRECEDENCE["Mul"])
            return "(" + "*".join([b] * int(exp)) + ")"
        if exp == sympy.Rational(-1, 2):
            return f"(1.0F/sqrtf({self._print(base)}))"
        return super()._print_Pow(expr)


_PRINTER = None


def c_expression(expr: sympy.Expr) -> str:
    """`expr` over v0, v1, ... as a float32 C expression."""
    global _PRINTER
    if _PRINTER is None:
        _PRINTER = CudaPrinter()
    return _PRINTER.doprint(expr)


def kernels_dir() -> Path:
    """The runtime's kernel sources (ops.cu, deepdsl_common.cuh): the `kernels` folder of `deepdsl_runtime`."""
    return Path(deepdsl_runtime.__file__).resolve().parent / "kernels"


def sources_digest(program_source: str) -> str:
    """The runtime's `cuda.layout.kernel_sources_digest` of a program's `.cu` text (one rule for the compiler and
    the runtime)."""
    return kernel_sources_digest(program_source, kernels_dir())


def render_cuda(description, program: str | None = None) -> str:
    """The text of the `.cu` file of a `ProgramDescription` (`deepdsl.codegen.description`): its kernels, each
    with the expression and arity the description gives, printed as C. `program`: the program's file name as the
    header names it (default: the description's)."""
    from deepdsl.codegen import render

    kernels = [{"name": k.name, "text": sympy.sstr(k.expr), "c": c_expression(k.expr), "inputs": list(range(k.arity))}
               for k in description.kernels]
    return render("kernels.cu.jinja", name=description.name, program=program or description.filename,
                  version=description.version, source=description.source,
                  structure_hash=description.structure_hash, kernels=kernels)


def generate_cuda(compiled, options=None, program: str | None = None) -> str:
    """The text of the `.cu` file of the program `deepdsl.codegen.generate(compiled, options)` writes."""
    from deepdsl.codegen.description import describe

    return render_cuda(describe(compiled, options), program)


def write_cuda(description, program_path, build: bool = True) -> list[Path]:
    """Write `<program>.cu` of a `ProgramDescription` beside the program at `program_path` and, with `build` and
    nvcc installed, its fat binary (older fat binaries of the program are removed). Returns the files written."""
    from deepdsl.codegen import write_text_atomically

    program_path = Path(program_path)
    cu = program_path.with_suffix(".cu")
    write_text_atomically(cu, render_cuda(description, program_path.name))
    written = [cu]
    if build and find_nvcc():
        fatbin = build_fatbin(cu)
        if fatbin is not None:
            written.append(fatbin)
    return written


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.exists():
            return str(candidate)
    return None


def nvcc_command(cu: Path, output: Path, kind: str = "fatbin", archs=ARCHS, nvcc: str | None = None) -> list[str]:
    """The nvcc command line compiling `cu` (with the runtime's kernel directory on the include path): a fat binary
    for `archs` (PTX of the last one included), or with kind "cubin" one cubin, with kind "ptx" the PTX, for the
    single arch given."""
    command = [nvcc or find_nvcc() or "nvcc", f"-{kind}", "-O3", "-std=c++17", "-I", str(kernels_dir())]
    if kind in ("cubin", "ptx"):
        (arch,) = archs
        command += [f"-arch={'sm' if kind == 'cubin' else 'compute'}_{arch}"]
    else:
        for arch in archs:
            code = f"[sm_{arch},compute_{arch}]" if arch == archs[-1] else f"sm_{arch}"
            command += ["-gencode", f"arch=compute_{arch},code={code}"]
    return command + ["-o", str(output), str(cu)]


def build_fatbin(cu, nvcc: str | None = None) -> Path | None:
    """Compile `cu` into `<stem>.<digest>.fatbin` beside it (None when nvcc fails: the program then compiles the
    source when it starts, and nvcc's complaint is printed)."""
    cu = Path(cu)
    target = cu.with_name(f"{cu.stem}.{sources_digest(cu.read_text())}.fatbin")
    for old in cu.parent.glob(f"{cu.stem}.*.fatbin"):
        if old != target:
            old.unlink()
    if target.exists():
        return target
    partial = target.with_name(target.name + ".partial")
    result = subprocess.run(nvcc_command(cu, partial, nvcc=nvcc), capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        print(f"deepdsl: nvcc could not build {target.name}; the program will compile {cu.name} when it starts:\n"
              f"{result.stderr.strip()}", file=sys.stderr)
        return None
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepdsl.codegen.cuda", description="Build the fat binary of a "
                                     "generated program's CUDA kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile <program>.cu into <program>.<digest>.fatbin beside it")
    build.add_argument("cu", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if not find_nvcc():
        print("deepdsl: nvcc not found (install the CUDA toolkit or set CUDA_HOME)", file=sys.stderr)
        return 1
    status = 0
    for cu in args.cu:
        fatbin = build_fatbin(cu)
        if fatbin is None:
            status = 1
        else:
            print(f"wrote {fatbin}")
    return status


if __name__ == "__main__":
    sys.exit(main())
