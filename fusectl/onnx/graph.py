"""ONNX graphs as onnx-ir loads them: ``load_model`` and the checks before it live in
:mod:`fusectl.io.formats.onnx_file` (all file reading is in ``io/``); graph views live here."""

from __future__ import annotations

import numpy as np

from ..io.formats.onnx_file import check_model_file, external_data_files, load_model

__all__ = ["check_model_file", "external_data_files", "initializer_views", "load_model"]


def initializer_views(model):
    """(readers, specs) of the graph's initializers: name → () -> array, name → (dtype, shape)."""
    readers, specs = {}, {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None:
            continue
        readers[name] = (lambda t=tensor: np.asarray(t.numpy()))
        specs[name] = (str(tensor.dtype.numpy()), tuple(int(d) for d in tensor.shape))
    return readers, specs
