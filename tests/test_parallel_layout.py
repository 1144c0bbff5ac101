"""Parallel layouts (``fusectl/rules/parallel.py``): the layout file's splits, the pieces they make
in both directions, and the ledger that proves a Megatron conversion uses every element once."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from fusectl.cli import main
from fusectl.errors import CheckpointError, PlanError, RuleError
from fusectl.io.formats import megatron, megatron_writer
from fusectl.io.formats.megatron import read_megatron
from fusectl.rules.parallel import Ledger, Split, load_layout, shipped_layout

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")
LEGACY = sorted(n for n in os.listdir(FIXTURES) if n.endswith("-legacy"))


def _layout(body: str) -> str:
    return 'version = 1\n[[parallel]]\nkind = "k"\nnames = ["{p*}.w"]\n' + body


# ------------------------------------------------------------------------------- the file


def test_runs_invert_each_other_for_every_split():
    """Every rank's slices, laid end to end, are the rank's piece; together they tile the axis."""
    for split in (Split("column", 0), Split("row", 1), Split("column-swiglu", 0, 2), Split("thirds", 0, 3)):
        for tp in (1, 2, 4):
            length = split.parts * tp * 3
            whole = np.arange(length)
            runs = split.runs(length, tp)
            pieces = [np.concatenate([whole[at:at + n] for _, at, n in rank]) for rank in runs]
            assert all(len(p) == length // tp for p in pieces)
            for rank in runs:  # each slice starts on the rank where the one before it ends
                assert [s for s, _, _ in rank] == [sum(n for _, _, n in rank[:k]) for k in range(len(rank))]
            assert sorted(np.concatenate(pieces).tolist()) == whole.tolist()


def test_swiglu_runs_are_megatrons_gate_and_up_halves():
    # rank r holds [gate_r; up_r]: of 8 rows (gate 0..3, up 4..7) over 2 ranks, rank 1 has 2,3,6,7
    assert [at for _, at, _ in Split("column-swiglu", 0, 2).runs(8, 2)[1]] == [2, 6]


def test_a_split_that_does_not_divide_is_refused():
    assert not Split("column-swiglu", 0, 2).divides(6, 2)
    with pytest.raises(ValueError, match="does not split in 2 parts over 2 ranks"):
        Split("column-swiglu", 0, 2).runs(6, 2)


def test_the_shipped_layout_names_every_fixture_tensor():
    """Every tensor of every legacy fixture has a split in the shipped layout, and the kind the
    reader reports is the layout's."""
    layout = shipped_layout("megatron-core")
    for name in LEGACY:
        contents = read_megatron(os.path.join(FIXTURES, name))
        kinds = contents.distributed["parallel"]
        for tensor, kind in kinds.items():
            split = layout.split_of(tensor, {"swiglu": True})
            assert split is not None and split.kind == kind, (name, tensor)


def test_when_flag_chooses_the_split():
    layout = shipped_layout("megatron-core")
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    assert layout.split_of(name, {"swiglu": True}).kind == "column-swiglu"
    assert layout.split_of(name, {"swiglu": False}).kind == "column"
    assert layout.split_of(name, {}).kind == "column"
    assert layout.split_of("decoder.layers.0.mlp.experts.linear_fc1.weight0", {}) is None


@pytest.mark.parametrize("body, message", [
    ("axis = 0\nparts = 0", "parts must be an integer 1 … 64"),
    ("parts = 2", "needs an axis"),
    ("axis = -1", "axis must be an integer 0 … 7"),
    ("axis = 0\nwhen = 3", "when must name a flag"),
    ("axis = 0\nsplit = 2", "unknown key 'split'"),
    ('axis = 0\n[[parallel]]\nkind = "k"\nnames = ["{p*}.v"]\naxis = 1', "kind 'k' is declared before"),
])
def test_bad_layout_files_are_refused(body, message):
    with pytest.raises(RuleError, match=message):
        load_layout(_layout(body), "l.toml")


@pytest.mark.parametrize("text, message", [
    ("version = 2", "'version = 1' is required"),
    ("version = 1", "lists its splits as \\[\\[parallel\\]\\] tables"),
    ("version = 1\nparallel = [1]", "must be a table"),
    ('version = 1\n[[parallel]]\nkind = ""\nnames = ["a"]', "kind must be a name"),
    ('version = 1\n[[parallel]]\nkind = "replicated"\nnames = ["a"]\naxis = 0', "kind must be a name"),
    ('version = 1\n[[parallel]]\nkind = "k"\nnames = []', "names must be a list"),
    ('version = 1\n[[parallel]]\nkind = "k"\nnames = ["{x"]', "malformed placeholder"),
    ('version = 1\ndescription = 3\n[[parallel]]\nkind = "k"\nnames = ["a"]', "description must be a string"),
    ("version = [", "not valid TOML"),
])
def test_bad_layout_documents_are_refused(text, message):
    with pytest.raises(RuleError, match=message):
        load_layout(text, "l.toml")


def test_pipeline_and_expert_tables_number_layers_and_experts_from_zero_per_rank():
    """The shipped [pipeline] / [experts]: what the reader renumbers a rank's names by and the
    writer renumbers them back by (tests/test_megatron*.py prove the two on megatron's files)."""
    layout = shipped_layout("megatron-core")
    layers, experts = layout.layers, layout.experts
    name = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert (layers.index(name), experts.index(name)) == (3, 5)
    # stage 1 of 2 of 4 layers, EP rank 1 of 2 of 8 experts: layer 1, expert 1
    staged = layers.on_rank(name, 1, 2)
    assert staged == "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert experts.on_rank(staged, 1, 4) == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert layers.on_rank(name, 0, 2) is None and experts.on_rank(name, 0, 4) is None
    assert experts.renumbered(experts.on_rank(name, 1, 4), 4) == name
    assert experts.index("decoder.layers.0.mlp.experts.linear_fc1.weight0") is None  # grouped: not per rank
    with pytest.raises(ValueError, match="move by -6"):
        experts.renumbered(name, -6)
    assert [layout.stage(n, 4) for n in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                                         "output_layer.weight", "decoder.layers.0.input_layernorm.weight")] == \
        [0, 3, 3, None]


@pytest.mark.parametrize("body, message", [
    ('[pipeline]\nlayers = "decoder.layers.{i}.{r*}"', "must hold one \\{x:int\\} placeholder"),
    ('[pipeline]\nlayers = "layers.{i:int}.{j:int}.{r*}"', "must hold one \\{x:int\\} placeholder"),
    ('[pipeline]\nlayers = 3', "layers: must be a name pattern"),
    ('[pipeline]\nfirst = "embedding.{r*}"', "first: must be a list of name patterns"),
    ('[pipeline]\nstages = 2', "unknown key 'stages'"),
    ('[experts]\nexpert = "{p*}.experts.{i:int}"', "unknown key 'expert'"),
    ('[experts]\nnames = "{p*}.experts.{i:int"', "malformed placeholder"),
])
def test_bad_pipeline_or_expert_tables_are_refused(body, message):
    with pytest.raises(RuleError, match=message):
        load_layout(_layout("axis = 0\n" + body), "l.toml")


def test_unknown_kind_is_a_key_error():
    with pytest.raises(StopIteration):
        shipped_layout("megatron-core").kind("diagonal")


# ------------------------------------------------------------------------------- the ledger


def _ledger() -> Ledger:
    ledger = Ledger()
    ledger.output("w", (4, 3), 0)
    for rank in range(2):
        ledger.source(f"r{rank}", (2, 3), 0)
    return ledger


def test_ledger_counts_a_complete_plan():
    ledger = _ledger()
    ledger.take("r0", 0, "w", 0, 2)
    ledger.take("r1", 0, "w", 2, 2)
    ledger.source("n0", (3,), None)
    ledger.source("n1", (3,), None)
    ledger.output("n", (3,), None)
    ledger.take("n0", 0, "n", 0, 1)
    ledger.copy("n1", "n0")
    assert ledger.check(ValueError) == {"source_tensors": 3, "source_elements": 15, "source_copies": 1,
                                        "output_tensors": 2, "output_elements": 15, "output_copies": 0}


@pytest.mark.parametrize("takes, message", [
    ([("r0", 0, 0, 2), ("r1", 0, 1, 2)], "'w': rows 1 … 1 are used twice"),
    # rank 1's piece forgotten, rank 0's read twice
    ([("r0", 0, 0, 2), ("r0", 0, 2, 2)], "'r0': rows 0 … 1 are used twice"),
    ([("r0", 0, 0, 2), ("r1", 1, 2, 1)], "'r1': rows 0 … 0 of its 2 are never read: the plan would drop them"),
    ([("r0", 0, 0, 2), ("r1", 0, 3, 2)], "'w': rows 2 … 2 of its 4 have no source"),
])
def test_ledger_refuses_elements_used_twice_or_never(takes, message):
    ledger = _ledger()
    for source, start, at, count in takes:
        ledger.take(source, start, "w", at, count)
    with pytest.raises(ValueError, match=message):
        ledger.check(ValueError)


def test_ledger_refuses_an_overrun():
    ledger = Ledger()
    ledger.source("a", (3, 2), 1)
    ledger.output("b", (3, 2), 1)
    ledger.take("a", 0, "b", 0, 3)
    with pytest.raises(ValueError, match="'a': the plan uses 3 columns of its 2"):
        ledger.check(ValueError)


def test_ledger_refuses_a_copy_of_nothing_or_a_copy_also_taken():
    ledger = _ledger()
    ledger.take("r0", 0, "w", 0, 2)
    ledger.take("r1", 0, "w", 2, 2)
    ledger.source("x", (3,), None)
    ledger.copy("x", "missing")
    with pytest.raises(ValueError, match="'x': a copy of 'missing', which is not one source the plan takes once"):
        ledger.check(ValueError)
    ledger = _ledger()
    ledger.take("r0", 0, "w", 0, 2)
    ledger.copy("r1", "r0")
    ledger.take("r1", 0, "w", 2, 2)
    with pytest.raises(ValueError, match="'r1': a copy of 'r0'"):
        ledger.check(ValueError)


# ------------------------------------------------------------------------------- the proof on real saves


@pytest.mark.parametrize("name", LEGACY)
def test_every_fixture_is_accounted_element_by_element(name):
    """The reader's ledger: the rank files' elements (model and moments) equal the TP=1 model's
    and moments' elements, each taken once; the copies are the replicated tensors' other ranks."""
    contents = read_megatron(os.path.join(FIXTURES, name))
    a = contents.distributed["accounted"]
    model = sum(t.spec.numel for t in contents.tensors.values())
    tree = contents.training.tree()
    moments = sum(v.spec.numel for s in tree["optimizer"]["state"].values() for k, v in s.items()
                  if k != "step" and hasattr(v, "spec"))
    assert a["source_elements"] == a["output_elements"] == model + moments
    tp, ep = contents.distributed["tp"], contents.distributed["ep"]
    replicated = [n for n, k in contents.distributed["parallel"].items() if k == "replicated"]
    heads = tp if "tied_head_copy" in contents.distributed else 0  # the last stage's head, per TP rank
    if ep == 1:
        assert a["source_copies"] == len(replicated) * (tp - 1) + heads


def test_a_reader_that_drops_a_slice_is_caught(monkeypatch):
    """Were the split to forget each rank's second part (the up half), the ledger names the rows
    of the whole left without a source before the tensor is assembled."""
    runs = Split.runs

    def forgetful(self, length, tp):
        out = runs(self, length, tp)
        return [r[:1] for r in out] if self.parts > 1 else out

    monkeypatch.setattr(Split, "runs", forgetful)
    with pytest.raises(CheckpointError,
                       match=r"'decoder.layers.0.mlp.linear_fc1.weight': rows 32 … 63 of its 64 have no source"):
        read_megatron(os.path.join(FIXTURES, "gpt-tp2-legacy"))


def test_a_writer_that_writes_a_slice_twice_is_caught(monkeypatch, tmp_path):
    runs = Split.runs

    def doubled(self, length, tp):
        out = runs(self, length, tp)
        return [out[0] for _ in out] if self.kind == "row" else out

    contents = read_megatron(os.path.join(FIXTURES, "gpt-tp2-legacy"))
    monkeypatch.setattr(Split, "runs", doubled)
    with pytest.raises(PlanError, match=r"'decoder.layers.0.self_attention.linear_proj.weight': columns 0 … 7 are "
                                        "used twice"):
        megatron_writer.write_megatron(str(tmp_path / "out"), contents.tensors, tp=2, pp=1,
                                       config=megatron.saved_args(os.path.join(FIXTURES, "gpt-tp2-legacy")),
                                       tied=False)
    assert not os.listdir(tmp_path)


def test_a_layout_piece_that_is_not_whole_parts_is_refused(tmp_path):
    """A rank file whose SwiGLU fc1 has an odd number of rows cannot be [gate_r; up_r]."""
    contents = read_megatron(os.path.join(FIXTURES, "gpt-tp2-legacy"))
    assert contents.distributed["parallel"]["decoder.layers.0.mlp.linear_fc1.weight"] == "column-swiglu"
    from fusectl.tensors import ArrayTensor, TensorSpec
    from fusectl.dtypes import from_numpy
    odd = np.zeros((3, 4), np.float32)
    tensor = ArrayTensor(TensorSpec(from_numpy(odd.dtype, "x"), odd.shape), odd)
    with pytest.raises(CheckpointError, match="axis 0 holds 2 equal part"):
        megatron.join("column-swiglu", "x", [("a", "x", tensor), ("b", "x", tensor)], Ledger())


def test_inspect_says_every_element_is_accounted_for():
    result = CliRunner().invoke(main, ["inspect", os.path.join(FIXTURES, "gpt-tp2-pp2-legacy")])
    assert result.exit_code == 0, result.output
    assert "parallel kinds: column 4, replicated 5, row 4, column-swiglu 2" in result.output
    line = next(l for l in result.output.splitlines() if l.startswith("every element accounted for"))
    as_json = CliRunner().invoke(main, ["inspect", "--json", os.path.join(FIXTURES, "gpt-tp2-pp2-legacy")])
    a = json.loads(as_json.output)["distributed"]["accounted"]
    assert f"{a['source_elements']} element(s), each taken once" in line and a["output_copies"] == 0


def test_a_model_written_at_tp4_reads_back_bitwise(tmp_path):
    """The issue's TP=4: the fixtures' 2 query groups cannot split over 4 ranks (megatron-core
    refuses that too), so this is a model of the same kind with 4 groups (multi-head attention).
    Written at TP=4 × PP=2 and read back, every tensor is bitwise the input (the writer's and the
    reader's ledgers both hold), and a rank file holds the piece the layout says."""
    from fusectl.dtypes import from_numpy
    from fusectl.tensors import ArrayTensor, TensorSpec

    rng = np.random.default_rng(4)
    hidden, heads, head_dim, ffn, vocab, layers = 16, 4, 4, 32, 64, 2
    shapes = {"embedding.word_embeddings.weight": (vocab, hidden), "decoder.final_layernorm.weight": (hidden,),
              "output_layer.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "self_attention.linear_qkv.weight": (3 * heads * head_dim, hidden),
                   p + "self_attention.linear_proj.weight": (hidden, heads * head_dim),
                   p + "pre_mlp_layernorm.weight": (hidden,), p + "mlp.linear_fc1.weight": (2 * ffn, hidden),
                   p + "mlp.linear_fc2.weight": (hidden, ffn)}
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    tensors = {n: ArrayTensor(TensorSpec(from_numpy(a.dtype, n), a.shape), a) for n, a in arrays.items()}
    config = {"num_attention_heads": heads, "num_query_groups": heads, "kv_channels": head_dim}
    out = tmp_path / "tp4"
    files, _, _ = megatron_writer.write_megatron(str(out), tensors, tp=4, pp=2, config=config, tied=False)
    assert files == 8
    back = read_megatron(str(out))
    assert back.distributed["tp"] == 4 and back.distributed["pp"] == 2
    assert back.distributed["accounted"]["output_elements"] == sum(a.size for a in arrays.values())
    for name, array in arrays.items():
        assert back.tensors[name].read().tobytes() == array.tobytes(), name
    # TP rank 3 of stage 1 holds layer 1 as its layer 0: of fc1, the last quarter of each SwiGLU
    # half (gate rows 24…31, up rows 56…63); of linear_proj, columns 12…15
    from fusectl.io.formats.torch_file import read_torch_tree
    tree, _ = read_torch_tree(str(out / "release" / "mp_rank_03_001" / "model_optim_rng.pt"), records=megatron.RECORDS)
    fc1 = arrays["decoder.layers.1.mlp.linear_fc1.weight"]
    proj = arrays["decoder.layers.1.self_attention.linear_proj.weight"]
    assert np.array_equal(tree["model"]["decoder.layers.0.mlp.linear_fc1.weight"].read(),
                          np.concatenate([fc1[24:32], fc1[56:64]]))
    assert np.array_equal(tree["model"]["decoder.layers.0.self_attention.linear_proj.weight"].read(), proj[:, 12:16])
