"""``--param-order-from-model`` (fusectl/io/model_order.py) runs only code that ships with
transformers and believes the config's sizes only as far as the checkpoint's tensors go: a Hub
kernel named in config.json is never fetched, a build that asks for one is refused, a config
larger than the checkpoint stops the build at once, and SIGTERM while building still ends the run
(exit 143, nothing written). Needs torch and transformers."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from conftest import run_cli, snapshot
from fusectl.errors import CheckpointError
from test_trainer_folder import CHECKPOINT, RULES, llama_order

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")

from fusectl.io.checkpoint import open_checkpoint  # noqa: E402 (after the skips)
from fusectl.io.model_order import order_from_model  # noqa: E402

CONFIG = json.loads((CHECKPOINT / "config.json").read_text())
# the shapes of the parameters the checkpoint holds: what the model is built within
HELD = [t.spec.shape for t in open_checkpoint(str(CHECKPOINT)).table.entries.values()]


@pytest.fixture
def hub_calls(monkeypatch):
    """Every call that reaches transformers' Hub kernel loader (none may)."""
    calls = []
    monkeypatch.setattr(hub_kernels, "get_kernel", lambda *args, **kwargs: calls.append(args))
    return calls


@pytest.fixture
def sigterm_restored():
    """The CLI installs its own SIGTERM handler; put pytest's back afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _folder(tmp_path, **changes):
    """A copy of the Trainer checkpoint whose config.json has ``changes``."""
    folder = tmp_path / "in" / "checkpoint-2"
    shutil.copytree(CHECKPOINT, folder)
    (folder / "config.json").write_text(json.dumps(dict(CONFIG, **changes)))
    return folder


def _built_with(monkeypatch, before):
    """LlamaForCausalLM's constructor runs ``before()`` first."""
    real = transformers.LlamaForCausalLM.__init__

    def init(self, config, *args, **kwargs):
        before()
        real(self, config, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", init)


@pytest.mark.parametrize("changes", [
    {"attn_implementation": "kernels-community/flash-attn2"},
    {"_attn_implementation": "kernels-community/flash-attn2", "experts_implementation": "kernels-community/moe"},
    {"auto_map": {"AutoModelForCausalLM": "modeling_evil.Model"}, "trust_remote_code": True},
], ids=["attn", "private-attn-and-experts", "auto-map"])
def test_config_fields_that_reach_the_hub_are_overridden_and_nothing_is_fetched(hub_calls, changes):
    assert order_from_model(dict(CONFIG, **changes), "config.json", HELD) == llama_order()
    assert hub_calls == []


def test_the_model_is_built_with_eager_attention(monkeypatch):
    seen = []
    real = transformers.LlamaForCausalLM.__init__

    def init(self, config, *args, **kwargs):
        seen.append(config._attn_implementation)
        real(self, config, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", init)
    order_from_model(dict(CONFIG, attn_implementation="sdpa"), "config.json", HELD)
    assert seen == ["eager"]


@pytest.mark.parametrize("loader", ["transformers", "kernels"])
def test_a_build_that_asks_for_a_hub_kernel_is_refused_and_nothing_is_fetched(hub_calls, monkeypatch, loader):
    # MRA, YOSO and RWKV fetch their kernels in the constructor; any model could
    kernels = pytest.importorskip("kernels") if loader == "kernels" else None
    if kernels is not None:
        monkeypatch.setattr(kernels, "get_kernel", lambda *args, **kwargs: hub_calls.append(args))
    module = kernels or hub_kernels
    _built_with(monkeypatch, lambda: module.get_kernel("kernels-community/mra", version=1))
    with pytest.raises(CheckpointError) as err:
        order_from_model(CONFIG, "config.json", HELD)
    assert "asked for the kernel 'kernels-community/mra' from the Hugging Face Hub" in str(err.value)
    assert "--param-order" in str(err.value) or "param_order=" in str(err.value)
    assert hub_calls == []
    module.get_kernel("after")  # the loader is given back afterwards
    assert hub_calls == [("after",)]


def test_a_refused_kernel_the_model_does_without_still_gives_the_order(hub_calls, monkeypatch):
    def optional_kernel():
        try:
            hub_kernels.get_kernel("kernels-community/mra")
        except Exception:  # what MRA's constructor does: warn and use its own code
            pass

    _built_with(monkeypatch, optional_kernel)
    assert order_from_model(CONFIG, "config.json", HELD) == llama_order()
    assert hub_calls == []


@pytest.mark.parametrize("changes,said", [
    ({"num_hidden_layers": 100_000}, "elements, the checkpoint holds 6736"),
    ({"hidden_size": 2**20, "intermediate_size": 2**22, "head_dim": 2**18}, "elements, the checkpoint holds 6736"),
    ({"vocab_size": 10**12}, "elements, the checkpoint holds 6736"),
], ids=["layers", "hidden", "vocab"])
def test_a_config_larger_than_the_checkpoint_stops_the_build_at_once(monkeypatch, changes, said):
    layers = []
    real = transformers.models.llama.modeling_llama.LlamaDecoderLayer.__init__

    def layer(self, *args, **kwargs):
        layers.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaDecoderLayer, "__init__", layer)
    with pytest.raises(CheckpointError) as err:
        order_from_model(dict(CONFIG, **changes), "config.json", HELD)
    assert "config.json: the LlamaForCausalLM it describes is larger than the checkpoint" in str(err.value)
    assert said in str(err.value) and "param_order=" in str(err.value)
    assert len(layers) < 20  # the checkpoint holds 2 layers: stopped within the first few, not after 100,000


def test_many_small_layers_past_the_parameter_count_are_refused():
    # a checkpoint of large tensors and few of them: the count stops the build, not the elements
    held = [(10**6,)] * 4
    with pytest.raises(CheckpointError, match=r"more than 80 parameters, the checkpoint holds 4"):
        order_from_model(dict(CONFIG, num_hidden_layers=1000), "config.json", held)


def test_larger_config_through_the_cli_is_exit_2_and_nothing_written(tmp_path):
    folder = _folder(tmp_path, num_hidden_layers=100_000)
    before = snapshot(tmp_path)
    result = run_cli("fuse", folder, *RULES, "--param-order-from-model", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "is larger than the checkpoint" in result.stderr and "--param-order FILE" in result.stderr
    assert snapshot(tmp_path) == before


def test_sigterm_while_the_model_is_built_is_exit_143_and_nothing_written(tmp_path, monkeypatch, sigterm_restored):
    import os
    folder = _folder(tmp_path)
    _built_with(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = snapshot(tmp_path)
    result = run_cli("fuse", folder, *RULES, "--param-order-from-model", "-o", tmp_path / "out")
    assert result.exit_code == 143, result.output
    assert result.stderr == "error: terminated; no output was written\n"
    assert snapshot(tmp_path) == before


def test_a_hub_kernel_in_the_folders_config_plans_with_the_order_from_its_model(tmp_path, hub_calls):
    folder = _folder(tmp_path, attn_implementation="kernels-community/flash-attn2")
    result = run_cli("plan", folder, *RULES, "--param-order-from-model", "--json")
    assert result.exit_code == 0, result.stderr
    outputs = [o for g in json.loads(result.stdout)["groups"] for s in g["steps"] for o in s["outputs"]]
    assert "model.layers.0.self_attn.qkv_proj.weight::exp_avg" in outputs
    assert hub_calls == []

