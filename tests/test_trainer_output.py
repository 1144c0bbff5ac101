"""Where a Trainer folder's output takes its optimizer order from (trainer_output.py): with
``--param-order-from-model`` the model is built from the OUTPUT's config.json, so an output with
none is refused before anything is written, naming the option that gives the order instead."""

from __future__ import annotations

import shutil

from conftest import run_cli, snapshot
from test_trainer_folder import CHECKPOINT, RULES, orders  # noqa: F401 (a fixture)


def test_param_order_from_model_without_a_config_json_is_refused(tmp_path, orders):  # noqa: F811
    folder = tmp_path / "in" / "checkpoint-2"
    shutil.copytree(CHECKPOINT, folder)
    config = tmp_path / "config.json"  # the rules' sizes come from here; the folder has none
    (folder / "config.json").rename(config)
    before = snapshot(tmp_path / "in")
    out = tmp_path / "out"
    result = run_cli("fuse", folder, *RULES, "--config", config, "--param-order", orders[0],
                     "--param-order-from-model", "-o", out)
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: {folder}: no config.json to build the new model from for "
                             "--param-order-from-model; give --param-order-out FILE\n")
    assert not out.exists() and list(tmp_path.glob("*fusectl-tmp*")) == []
    assert snapshot(tmp_path / "in") == before
