"""Default tolerances by dtype: how close a recomputed float must be to count as equal.

Verify compares with them, and export and name mapping use them to accept a folded weight or
a content match; they live below both so that neither imports the other.
"""

from __future__ import annotations

import numpy as np

# (atol, rtol) by dtype; integer and bool outputs must match exactly
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float64": (1e-5, 1e-5),
    "float16": (1e-3, 1e-3),
    "bfloat16": (1e-2, 1e-2),
}
FP8_TOLERANCE = (1e-1, 1e-1)


def default_tolerance(dtype: np.dtype) -> tuple[float, float]:
    """(atol, rtol) for a dtype: fp32 1e-5, fp16 1e-3, bf16 1e-2, fp8 1e-1, integers exact.

    >>> default_tolerance(np.float16), default_tolerance(np.int64)
    ((0.001, 0.001), (0.0, 0.0))
    """
    dtype = np.dtype(dtype)
    if dtype.name in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype.name]
    if dtype.name.startswith("float8"):
        return FP8_TOLERANCE
    return (0.0, 0.0)
