"""What an MXNet checkpoint's ``-symbol.json`` says that a rule cannot: the BatchNorms' ``eps``
and ``fix_gamma`` and the layer each one follows, handed to the ``bn_fold`` rules bound to it
(:class:`fusectl.ops.reparam.BatchNormFacts`). A checkpoint that is no MXNet file gets nothing,
and its rules are unchanged; an MXNet file without a symbol (a ``save_parameters`` file) gets
facts that say so, and a ``bn_fold`` that does not write ``fix_gamma`` is then refused.
"""

from __future__ import annotations

import dataclasses

from .io.checkpoint import Checkpoint
from .io.formats.mxnet_symbol import Symbol, read_symbol
from .ops.reparam import BatchNormFacts, BnFold, NormFacts
from .rules.schema import RuleSet

SYMBOL_SUFFIX = "-symbol.json"


def batch_norm_facts(checkpoint: Checkpoint) -> BatchNormFacts | None:
    """The facts of an MXNet ``checkpoint`` (None for any other format): its symbol's
    BatchNorm nodes, each with the operator it reads and that operator's weight variable."""
    if checkpoint.format != "mxnet":
        return None
    params = checkpoint.files[0] if checkpoint.files else str(checkpoint.path)
    path = next((f for f in checkpoint.files if str(f).endswith(SYMBOL_SUFFIX)), None)
    if path is None:
        return BatchNormFacts(str(params), None)
    return BatchNormFacts(str(params), str(path), norms_of(read_symbol(str(path))))


def norms_of(symbol: Symbol) -> tuple[NormFacts, ...]:
    """Every BatchNorm of ``symbol`` that reads its gamma from a variable, as :class:`NormFacts`."""
    by_name = {node.name: node for node in symbol.nodes}
    found = []
    for norm in symbol.batch_norms():
        if norm.gamma is None:
            continue
        node = by_name[norm.name]
        layer = symbol.nodes[node.inputs[0]] if node.inputs else None
        weight = None
        if layer is not None and len(layer.inputs) > 1 and symbol.nodes[layer.inputs[1]].op == "null":
            weight = symbol.nodes[layer.inputs[1]].name
        found.append(NormFacts(norm.name, norm.gamma, norm.eps, norm.fix_gamma, norm.axis,
                               layer.name if layer is not None else None, layer.op if layer is not None else None,
                               weight))
    return tuple(found)


def with_facts(ruleset: RuleSet, facts: BatchNormFacts | None) -> RuleSet:
    """``ruleset`` with ``facts`` given to each of its ``bn_fold`` rules (unchanged for None)."""
    if facts is None or not any(isinstance(rule.op, BnFold) for rule in ruleset.rules):
        return ruleset
    rules = tuple(dataclasses.replace(rule, op=dataclasses.replace(rule.op, facts=facts))
                  if isinstance(rule.op, BnFold) else rule for rule in ruleset.rules)
    return dataclasses.replace(ruleset, rules=rules)


def with_checkpoint_facts(ruleset: RuleSet, checkpoint: Checkpoint) -> RuleSet:
    """``ruleset`` bound to ``checkpoint``'s facts (its symbol read only when a rule folds a BatchNorm)."""
    if not any(isinstance(rule.op, BnFold) for rule in ruleset.rules):
        return ruleset
    return with_facts(ruleset, batch_norm_facts(checkpoint))
