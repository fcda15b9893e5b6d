"""Host <-> device for the CPU backend: the identity (buffers are numpy arrays); between processes: `all_sum`."""
from __future__ import annotations

import numpy as np


def asarray(array: np.ndarray, dtype=None) -> np.ndarray:
    """A backend buffer holding a copy of a host array."""
    return np.array(array, dtype=dtype or array.dtype, order="C", copy=True)


def to_numpy(buffer: np.ndarray) -> np.ndarray:
    return np.array(buffer, copy=True)


def zeros(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def scalar(buffer) -> float:
    """The Python float of a 0-d value (the loss, the accuracy)."""
    return float(buffer)


def all_sum(x, *, out, ranks=None):
    """out = the sum of x over the ranks of a data-parallel job (`deepdsl_runtime.parallel.Ranks`, summing in its
    reduction mode, `ranks.mode`); x itself in one process (`ranks` None or alone). x may be a number (an example
    count)."""
    np.copyto(out, x)
    if ranks is not None and ranks.size > 1:
        ranks.reduce(out.reshape(-1))
