"""deepdsl: an ahead-of-time compiler for deep learning.

Network files (`networks/*.py`) build a `Loop` with the DSL in `deepdsl.dsl`; `deepdsl.compile(loop)` derives the
gradients symbolically, optimizes the SSA programs of the training and test steps, and returns them with everything
code generation and the memory planner need.
"""
__version__ = "0.1.0"

__all__ = ["CompileOptions", "Compiled", "compile", "load", "__version__"]


def __getattr__(name: str):
    """`load`, `compile`, `CompileOptions` and `Compiled`, imported on first use: the compiler loads sympy (a
    second), which the command line imports only after it has set its signal handlers (`deepdsl.cli`)."""
    if name == "load":
        from deepdsl.loader import load
        return load
    if name in ("CompileOptions", "Compiled", "compile"):
        from deepdsl import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'deepdsl' has no attribute {name!r}")
