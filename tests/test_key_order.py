"""An output's keys in the input's own order (issue 28.2).

``convert model.pth -o copy.pth`` wrote the state dict in the order of the storages' bytes, a
tied name beside its tensor rather than where the state dict held it; ``unfuse`` of a fused
folder did not give the original order back. Now every output lists its keys in the input's
order (a state dict's; a safetensors header's), each fused tensor where its first input was;
the bytes of a format that indexes them apart (safetensors, a torch.save zip) are still laid in
the order they are read. Where unfusing would not give the original order by itself (the parts
of a fused tensor were not adjacent), the provenance records it and ``unfuse`` takes it.
"""

from __future__ import annotations

import json
import struct
import zipfile

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, run_cli
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.key_order import output_order, recorded_order, reordered
from fusectl.ops import OPS
from fusectl.steps import Plan, Step, StepGroup
from fusectl.dtypes import BY_NAME
from fusectl.tensors import TensorSpec
from test_torch_reader import OD, i, pkl, s, storage, tensor, torch_zip

SPEC = TensorSpec(BY_NAME["F32"], (2,))
LLAMA = FIXTURES / "tiny-llama-gqa"


def step(kind: str, inputs, outputs, **params) -> Step:
    op = OPS[kind].from_params(params)
    return Step(op, tuple(inputs), tuple(outputs), (SPEC,) * len(inputs), (SPEC,) * len(outputs))


def plan(*steps: Step) -> Plan:
    return Plan((StepGroup("r", "rules.toml", tuple(steps)),))


def header_names(path) -> list[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def provenance(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(json.loads(f.read(n))["__metadata__"]["fusectl"])


# --- unit ------------------------------------------------------------------------------------


def test_a_made_tensor_takes_the_place_of_its_first_input():
    concat = plan(step("concat", ["q", "k", "v"], ["qkv"], axis=0))
    assert output_order(["k", "o", "q", "v"], concat, ["o", "qkv"]) == ["qkv", "o"]
    split = plan(step("split", ["qkv"], ["q", "k", "v"], axis=0, sizes=[1, 1, 1]))
    assert output_order(["a", "qkv", "o"], split, ["o", "v", "k", "q", "a"]) == ["a", "q", "k", "v", "o"]
    chain = Plan(plan(step("rename", ["b"], ["c"])).groups + plan(step("rename", ["c"], ["d"])).groups)
    assert output_order(["a", "b", "z"], chain, ["z", "d", "a"]) == ["a", "d", "z"]


def test_a_tied_name_the_input_did_not_list_follows_its_tensor_and_the_rest_come_last():
    ties = {"head": ["embed", "head"], "embed": ["embed", "head"]}
    assert output_order(["embed", "proj"], Plan(), ["proj", "extra", "head", "embed"], ties=ties) == \
        ["embed", "head", "proj", "extra"]


def test_a_preferred_order_reorders_only_the_places_its_names_hold():
    assert reordered(["x", "a", "y", "b"], ["b", "a"]) == ["x", "b", "y", "a"]
    assert output_order(["q", "k", "v", "o"], Plan(), ["q", "k", "v", "o"], preferred=["o", "q"]) == \
        ["o", "k", "v", "q"]


def test_the_original_order_is_recorded_only_where_unfusing_would_not_give_it():
    concat = plan(step("concat", ["q", "k", "v"], ["qkv"], axis=0))
    assert recorded_order(["q", "k", "v", "o"], ["qkv", "o"], concat) is None
    assert recorded_order(["k", "o", "q", "v"], ["qkv", "o"], concat) == ["k", "o", "q", "v"]
    folded = plan(step("drop", ["k"], []))
    assert recorded_order(["k", "q"], ["q"], folded) is None  # one-way: nothing unfuses it


# --- CLI ---------------------------------------------------------------------------------------


def views_in_reverse(path) -> str:
    """A torch.save zip whose state dict lists ``b`` (bytes 8..16 of its one storage) before ``a``
    (bytes 0..8): the dict's order is not its bytes'."""
    body = b"}q\x00(" + s("b") + tensor(offset=2, size=(2,)) + s("a") + tensor(offset=0, size=(2,)) + b"u"
    return torch_zip(path, pkl(body))


def test_convert_keeps_a_state_dicts_order_not_its_bytes(tmp_path):
    src = views_in_reverse(tmp_path / "m.pt")
    ok(run_cli("convert", src, "-o", tmp_path / "copy.pt"))
    assert list(read_torch_tree(str(tmp_path / "copy.pt"))[0]) == ["b", "a"]
    ok(run_cli("convert", src, "-o", tmp_path / "copy.safetensors"))
    assert header_names(tmp_path / "copy.safetensors") == ["b", "a"]
    ok(run_cli("convert", src, "-o", tmp_path / "copy.npz"))
    assert [n for n in np.load(tmp_path / "copy.npz").files if not n.startswith("__")] == ["b", "a"]


def test_a_tied_name_stays_where_the_state_dict_held_it(tmp_path):
    src = FIXTURES / "torch" / "tied.pt"
    ok(run_cli("convert", src, "-o", tmp_path / "copy.pt"))
    assert list(read_torch_tree(str(tmp_path / "copy.pt"))[0]) == list(read_torch_tree(str(src))[0])
    assert list(read_torch_tree(str(src))[0])[-1] == "head.weight"


def test_a_safetensors_header_keeps_its_order_where_it_is_not_its_bytes(tmp_path):
    src = tmp_path / "m.safetensors"
    a, z = np.arange(4, dtype=np.float32), np.arange(2, dtype=np.float32)
    header = {"z": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
              "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    src.write_bytes(struct.pack("<Q", len(raw)) + raw + a.tobytes() + z.tobytes())
    ok(run_cli("convert", src, "-o", tmp_path / "copy.safetensors"))
    assert header_names(tmp_path / "copy.safetensors") == ["z", "a"]
    ok(run_cli("convert", src, "-o", tmp_path / "copy.pt"))
    assert list(read_torch_tree(str(tmp_path / "copy.pt"))[0]) == ["z", "a"]


def test_unfuse_gives_back_the_original_order_of_parts_that_were_not_adjacent(tmp_path):
    # the header is sorted: k_proj, o_proj, q_proj, v_proj
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(run_cli("fuse", LLAMA, "-r", "llama-qkv", "-o", fused))
    names = header_names(fused / "model.safetensors")
    at = names.index("model.layers.0.self_attn.qkv_proj.weight")
    assert names[at + 1] == "model.layers.0.self_attn.o_proj.weight"  # where k_proj, the first part, was
    assert provenance(fused / "model.safetensors")["order"] == header_names(LLAMA / "model.safetensors")
    ok(run_cli("unfuse", fused, "-o", back))
    assert header_names(back / "model.safetensors") == header_names(LLAMA / "model.safetensors")
    ok(run_cli("convert", fused, "-o", tmp_path / "fused.pt"))  # the record travels with a conversion
    ok(run_cli("unfuse", tmp_path / "fused.pt", "-o", tmp_path / "back.pt"))
    assert list(read_torch_tree(str(tmp_path / "back.pt"))[0]) == header_names(LLAMA / "model.safetensors")


def test_adjacent_parts_need_no_record(tmp_path):
    # gate_proj and up_proj sit side by side in the sorted header
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(run_cli("fuse", LLAMA, "-r", "llama-gate-up", "-o", fused))
    assert "order" not in provenance(fused / "model.safetensors")
    ok(run_cli("unfuse", fused, "-o", back))
    assert header_names(back / "model.safetensors") == header_names(LLAMA / "model.safetensors")


def test_a_sharded_outputs_index_lists_the_keys_in_the_inputs_order(tmp_path):
    src = FIXTURES / "tiny-llama-gqa-bf16-sharded"
    out = tmp_path / "out"
    ok(run_cli("convert", src, "-o", out, "--max-shard-size", "20000"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == fusectl.open_checkpoint(str(src)).input_order()
    assert len(set(index["weight_map"].values())) > 1


def test_torch_loads_the_converted_state_dicts_in_their_order(tmp_path):
    torch = pytest.importorskip("torch")
    for name in ("tied.pt", "views.pt", "overlap.pt", "bert.bin"):
        src, out = FIXTURES / "torch" / name, tmp_path / f"{name}.pt"
        ok(run_cli("convert", src, "-o", out))
        assert list(torch.load(out, weights_only=True)) == list(torch.load(src, weights_only=False)), name
    with zipfile.ZipFile(tmp_path / "tied.pt.pt") as z:
        assert z.testzip() is None
