"""A model's parameter order from its own code: transformers' class for a ``config.json``,
built on PyTorch's meta device (no weights, no memory), asked for ``named_parameters()``.

An optimizer's integer ids follow the order its parameters were given in
(``[n for n, _ in model.named_parameters()]``, in groups); safetensors headers do not keep it.
Where torch and transformers are installed, ``--param-order-from-model``
(``param_order_from_model=True``) takes it from here instead of a file. This is an optional
extra, asked for explicitly: fusectl never imports torch or transformers otherwise (importing
them takes seconds), and it runs only code that ships with transformers — the class named by
``architectures`` in transformers itself, never a model's own code (``auto_map``,
``trust_remote_code``).
"""

from __future__ import annotations

import contextlib
import io

from ..errors import CheckpointError, option, printable


def order_from_model(config: dict, where: str) -> list[str]:
    """``[n for n, _ in model.named_parameters()]`` of the transformers model ``config`` (a parsed
    ``config.json``, read from ``where``) describes: its class is ``config["architectures"][0]``,
    its config class the one registered for ``config["model_type"]``.

    :raises CheckpointError: torch or transformers missing, a config without ``architectures`` /
        ``model_type``, a class transformers does not have, or one that cannot be built from
        the config; each says how to give the order as a file instead.
    """
    instead = (f"give the order as a file instead ({option('param_order')}: a JSON list "
               "[n for n, _ in model.named_parameters()])")
    try:
        import torch
        import transformers
    except ImportError as e:
        raise CheckpointError(f"{option('param_order_from_model')} needs torch and transformers, which are not "
                              f"installed ({e.name} is missing); {instead}") from None
    architectures = config.get("architectures")
    model_type = config.get("model_type")
    if not (isinstance(architectures, list) and architectures and type(architectures[0]) is str) \
            or type(model_type) is not str:
        raise CheckpointError(f"{printable(where)}: no 'architectures' and 'model_type' to build the model from; "
                              f"{instead}")
    name = architectures[0]
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{printable(where)}: transformers {transformers.__version__} has no model class "
                              f"{printable(name)} (a model's own code is never run); {instead}")
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
        built = config_class.from_dict(dict(config))
        with contextlib.redirect_stderr(io.StringIO()), torch.device("meta"):
            model = cls(built)
        return [n for n, _ in model.named_parameters()]
    except Exception as e:  # noqa: BLE001 (any failure of the model's constructor is the config's)
        raise CheckpointError(f"{printable(where)}: transformers could not build {printable(name)} from it "
                              f"({type(e).__name__}: {printable(str(e))[:200]}); {instead}") from None


