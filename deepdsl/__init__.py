"""deepdsl: an ahead-of-time compiler for deep learning.

Network files (`networks/*.py`) build a `Loop` with the DSL in `deepdsl.dsl`; `deepdsl.compile(loop)` derives the
gradients symbolically, optimizes the SSA programs of the training and test steps, and returns them with everything
code generation and the memory planner need.
"""
__version__ = "0.1.0"

from deepdsl.loader import load  # noqa: E402
from deepdsl.pipeline import CompileOptions, Compiled, compile  # noqa: E402,A004

__all__ = ["CompileOptions", "Compiled", "compile", "load", "__version__"]
