"""Host <-> device for the CPU backend: the identity (buffers are numpy arrays)."""
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
