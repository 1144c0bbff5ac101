"""A model's parameter order from its own code: transformers' class for a ``config.json``,
built on PyTorch's meta device (no weights, no memory), asked for ``named_parameters()``.

An optimizer's integer ids follow the order its parameters were given in
(``[n for n, _ in model.named_parameters()]``, in groups); safetensors headers do not keep it.
Where torch and transformers are installed, ``--param-order-from-model``
(``param_order_from_model=True``) takes it from here instead of a file. This is an optional
extra, asked for explicitly: fusectl never imports torch or transformers otherwise (importing
them takes seconds), and it runs only code that ships with transformers — the class named by
``architectures`` in transformers itself, never a model's own code (``auto_map``,
``trust_remote_code``) nor a kernel from the Hub (an ``attn_implementation`` such as
``kernels-community/flash-attn2``: the model is built with eager attention, and any request
for a Hub kernel while it is built is refused).

The config is a file like any other: its sizes are believed only as far as the checkpoint's
tensors bear them out. The build stops as soon as the model it makes has more parameters, or
more elements, than the checkpoint holds (``num_hidden_layers: 100000`` beside two layers'
weights is refused at once, not built for minutes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..errors import CheckpointError, option, printable, quote

# config.json fields through which transformers reaches past its own code: an attention or
# experts implementation may name a Hub repository whose compiled kernel it downloads and
# imports; auto_map and trust_remote_code name a model's own code. Removed at every level of
# the config (sub-configs have their own); the attention is then set to eager.
_REACHES_OUT = frozenset({"attn_implementation", "_attn_implementation", "_attn_implementation_internal",
                          "experts_implementation", "_experts_implementation", "_experts_implementation_internal",
                          "auto_map", "trust_remote_code"})


def order_from_model(config: dict, where: str, held: Iterable[tuple[int, ...]]) -> list[str]:
    """``[n for n, _ in model.named_parameters()]`` of the transformers model ``config`` (a parsed
    ``config.json``, read from ``where``) describes: its class is ``config["architectures"][0]``,
    its config class the one registered for ``config["model_type"]``. ``held`` is the shape of
    each parameter the checkpoint holds: the model is built only as far as they go.

    :raises CheckpointError: torch or transformers missing, a config without ``architectures`` /
        ``model_type``, a class transformers does not have, one that cannot be built from the
        config, a config that describes a larger model than ``held``, or a build that asks for
        code from the Hub; each says how to give the order as a file instead.
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
    budget = _Budget.of(held)
    refused: list[str] = []
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
        built = config_class.from_dict(_own_code_config(config))
        built._attn_implementation = "eager"  # the setter sets every sub-config's too
        with contextlib.redirect_stderr(io.StringIO()), torch.device("meta"), _hub_kernels_refused(refused), \
                budget.enforced():
            model = cls(built)
        if budget.exceeded is None:
            return [n for n, _ in model.named_parameters()]
    except (_OverBudget, _HubKernelRefused):
        pass  # said below, also when the model's code caught the exception and went on
    except Exception as e:  # noqa: BLE001 (the constructor's errors for a bad config come in any type;
        # a termination is no Exception, see cli._Terminated)
        if budget.exceeded is None and not refused:
            raise CheckpointError(f"{printable(where)}: transformers could not build {printable(name)} from it "
                                  f"({type(e).__name__}: {printable(str(e))[:200]}); {instead}") from None
    if budget.exceeded is not None:
        raise CheckpointError(f"{printable(where)}: the {printable(name)} it describes is larger than the checkpoint: "
                              f"{budget.exceeded}; its sizes (layers, hidden sizes, experts) do not fit the "
                              f"checkpoint's tensors: correct the config, or {instead}")
    raise CheckpointError(f"{printable(where)}: building {printable(name)} asked for the kernel "
                          f"{quote(refused[0][:100])} from the Hugging Face Hub, which is not code that ships "
                          f"with transformers and is never run; {instead}")


def _own_code_config(config: dict) -> dict:
    """A copy of ``config`` without the fields of ``_REACHES_OUT``, at every level of nesting
    (in objects and lists of them); ``config`` itself is left as it was.

    >>> _own_code_config({"model_type": "llava", "attn_implementation": "kernels-community/flash-attn2",
    ...                   "text_config": {"auto_map": {"AutoModel": "evil.Model"}, "hidden_size": 8}})
    {'model_type': 'llava', 'text_config': {'hidden_size': 8}}
    """
    top = dict(config)
    stack: list[dict | list] = [top]
    while stack:  # no recursion: the nesting is the file's
        node = stack.pop()
        if isinstance(node, dict):
            for key in [k for k in node if k in _REACHES_OUT]:
                del node[key]
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, (dict, list)):
                node[key] = dict(value) if isinstance(value, dict) else list(value)
                stack.append(node[key])
    return top


class _HubKernelRefused(Exception):
    """Raised where transformers would have fetched a kernel from the Hub."""


@contextlib.contextmanager
def _hub_kernels_refused(refused: list[str]) -> Iterator[None]:
    """While the model is built, every request for a Hub kernel raises (and is recorded in
    ``refused``): through transformers' ``hub_kernels.get_kernel``, which its attention, model
    and quantization code call, the ``kernels`` function it wraps, and ``kernels.get_kernel``
    itself for code that imports it directly."""

    def refuse(kernel_name, *args, **kwargs):
        refused.append(str(kernel_name))
        raise _HubKernelRefused(str(kernel_name))

    targets = []
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    if hub_kernels is None and importlib.util.find_spec("transformers.integrations.hub_kernels") is not None:
        import transformers.integrations.hub_kernels as hub_kernels
    if hub_kernels is not None:
        targets += [(hub_kernels, attr) for attr in ("get_kernel", "get_kernel_hub") if hasattr(hub_kernels, attr)]
    if importlib.util.find_spec("kernels") is not None:
        import kernels
        targets += [(kernels, "get_kernel")] if hasattr(kernels, "get_kernel") else []
    saved = [(module, attr, getattr(module, attr)) for module, attr in targets]
    for module, attr, _ in saved:
        setattr(module, attr, refuse)
    try:
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


class _OverBudget(Exception):
    """Raised when the model being built outgrows the checkpoint."""


@dataclass
class _Budget:
    """What the checkpoint's parameters bear out: ``count`` parameters of ``elements`` elements
    in all. The model may register four times as many parameters and elements (ties and
    re-assignments register a parameter again; a fused layout counts the same elements) and
    eight times as many modules as that."""

    count: int
    elements: int
    exceeded: str | None = None  # what went past the budget, once it did
    _seen: dict[str, int] = field(default_factory=lambda: {"parameters": 0, "elements": 0, "modules": 0})

    @classmethod
    def of(cls, held: Iterable[tuple[int, ...]]) -> "_Budget":
        sizes = [math.prod(shape) for shape in held]
        return cls(len(sizes), sum(sizes))

    def _over(self) -> str | None:
        seen, parameters, elements = self._seen, 4 * self.count + 64, 4 * self.elements + 1024
        if seen["parameters"] > parameters:
            return f"more than {parameters} parameters, the checkpoint holds {self.count}"
        if seen["elements"] > elements:
            return f"more than {elements} elements, the checkpoint holds {self.elements}"
        if seen["modules"] > 8 * parameters:
            return f"more than {8 * parameters} modules for the checkpoint's {self.count} parameters"
        return None

    def _count(self, what: str, elements: int = 0) -> None:
        self._seen[what] += 1
        self._seen["elements"] += elements
        self.exceeded = self.exceeded or self._over()
        if self.exceeded is not None:
            raise _OverBudget(self.exceeded)

    @contextlib.contextmanager
    def enforced(self) -> Iterator[None]:
        """Every parameter and module the model registers is counted as it is made; past the
        budget each registration raises (and ``exceeded`` says why), so the build stops there."""
        from torch.nn.modules import module

        handles = [module.register_module_parameter_registration_hook(
                       lambda owner, name, param: self._count("parameters", param.numel())),
                   module.register_module_module_registration_hook(
                       lambda owner, name, child: self._count("modules"))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
