"""``unfuse -r`` changes only tensors it can prove the forward rule made (issue 18, item 1).

An inverted rule's pattern is the forward rule's output pattern, which may also match tensors
the forward rule left alone. With a provenance, the recorded steps of the rule say exactly which
tensors it made and every other tensor is left alone; without one nothing is proven (not even
an in-place step, whose names are the same before and after) and every binding is refused,
naming the tensor.
"""

from __future__ import annotations

import numpy as np

from conftest import (load_checkpoint_raw, metadata_of, ok, refused, with_provenance, without_origins, write_rules,
                      write_safetensors)

LLAMA = "tiny-llama-gqa"
GPT2 = "wild/gpt2-conv1d"
GPT2_RULES = "wild/gpt2-conv1d-to-linear.toml"
IN_PLACE_RULES = "wild/gpt2-mlp-in-place.toml"
STRIP = 'version = 1\n[[rule]]\nname = "strip"\nop = "rename"\ninput = "model.{r*}"\noutput = "{r*}"\n'


def test_a_prefix_strip_undone_with_its_rules_leaves_what_it_did_not_rename(cli, copy_fixture, tmp_path):
    """The issue's case: lm_head.weight was never under model., so it must stay lm_head.weight."""
    src = copy_fixture(LLAMA)
    rules = write_rules(tmp_path / "strip.toml", STRIP)
    fused, back = tmp_path / "fused.safetensors", tmp_path / "back.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    assert "lm_head.weight" in load_checkpoint_raw(fused) and "layers.0.mlp.up_proj.weight" in load_checkpoint_raw(fused)
    result = ok(cli("unfuse", fused, "-r", rules, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
    assert "left 1 tensor(s) alone" in result.stderr and "'lm_head.weight'" in result.stderr


def test_a_prefix_strip_without_provenance_is_refused_naming_the_tensor(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    rules = write_rules(tmp_path / "strip.toml", STRIP)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    stripped = with_provenance(fused, tmp_path / "stripped.safetensors")
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", stripped, "-r", rules, "-o", back),
            "rule 'strip (inverse)'", "'embed_tokens.weight' may be a tensor the forward rule left alone",
            "has no fusectl provenance", "fusectl unfuse CKPT -o OUT",
            unwritten=[back])


def test_gpt2_conv1d_rules_undone_leave_c_proj_alone(cli, fixtures_dir, copy_fixture, tmp_path):
    """The issue's GPT-2 case: the transpose's inverse pattern attn.{m}_proj.weight also fits
    attn.c_proj.weight (m = "c"), which the forward rule never touched; transformers would then
    re-initialise c_proj. The round trip must give transformers' own files back bitwise."""
    src = copy_fixture(GPT2)
    rules = fixtures_dir / GPT2_RULES
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    linear = load_checkpoint_raw(fused)
    assert {"transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.c_proj.weight"} <= set(linear)
    ok(cli("unfuse", fused, "-r", rules, "-o", back))
    restored = load_checkpoint_raw(back)
    assert "transformer.h.0.attn.c_conv1d.weight" not in restored
    assert restored == load_checkpoint_raw(src)


def test_gpt2_conv1d_rules_without_provenance_are_refused(cli, fixtures_dir, copy_fixture, tmp_path):
    src = copy_fixture(GPT2)
    rules = fixtures_dir / GPT2_RULES
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    stripped = with_provenance(fused, tmp_path / "stripped.safetensors")
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", stripped, "-r", rules, "-o", back, "--config", src / "config.json"),
            "rule 'conv1d-to-linear (inverse)'", "'transformer.h.0.attn.c_proj.weight' may be a tensor",
            "'transformer.h.0.attn.c_conv1d.weight'", unwritten=[back])


def test_an_in_place_step_without_provenance_is_refused(cli, fixtures_dir, copy_fixture, tmp_path):
    """An in-place transpose has the same names before and after, so a never-fused checkpoint
    looks exactly like a fused one: without a provenance nothing is proven and nothing changes.
    With the provenance the same rules undo it bitwise."""
    src = copy_fixture(GPT2)
    rules = fixtures_dir / IN_PLACE_RULES
    never_fused = tmp_path / "never.safetensors"
    refused(cli("unfuse", src, "-r", rules, "-o", never_fused),
            "'transformer.h.0.mlp.c_fc.weight' may be a tensor the forward rule left alone",
            "no fusectl provenance", unwritten=[never_fused])
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", fused, "-r", rules, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)


def test_a_provenance_without_the_rule_proves_it_made_nothing(cli, fixtures_dir, copy_fixture, tmp_path):
    """Fused with other rules, the provenance records no step of the in-place rule: it made
    nothing, so its inverse is refused rather than transposing what the other rules left."""
    src = copy_fixture(GPT2)
    other = write_rules(tmp_path / "other.toml", 'version = 1\n[[rule]]\nname = "ln"\nop = "rename"\n'
                                                 'input = "transformer.ln_f.{t}"\noutput = "transformer.ln_final.{t}"\n')
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", other, "-o", fused))
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", fused, "-r", fixtures_dir / IN_PLACE_RULES, "-o", back),
            "every tensor it matches is one the provenance", "did not make", unwritten=[back])


def test_rules_that_do_not_fit_the_recorded_steps_are_refused(cli, tmp_path):
    """An old-style provenance (no recorded rules text) matches the rule by name and source;
    a binding that overlaps a recorded step but is not its inverse is refused."""
    src = write_safetensors(tmp_path / "in.safetensors", {"a.w": _ones(2), "keep": _ones(1)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "rename"\ninput = "a.{x}"\noutput = "b.{x}"\n')
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    old = with_provenance(fused, tmp_path / "old.safetensors", without_origins)
    # the same file and rule name, edited after the fuse: it would now undo b.w into c.w
    write_rules(rules, 'version = 1\n[[rule]]\nop = "rename"\ninput = "c.{x}"\noutput = "b.{x}"\n')
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", old, "-r", rules, "-o", back), "would make 'c.w' from 'b.w'",
            "records rule '#1 rename'", "making 'b.w' from 'a.w'", unwritten=[back])


def test_a_rule_the_provenance_says_made_nothing_it_matches_is_refused(cli, copy_fixture, tmp_path):
    """Fused by one rule, undone with another whose pattern fits tensors the first one left:
    the provenance proves the second rule made none of them."""
    src = write_safetensors(tmp_path / "in.safetensors", {"a.w": _ones(2), "b.v": _ones(1)})
    first = write_rules(tmp_path / "first.toml", 'version = 1\n[[rule]]\nname = "r"\nop = "rename"\n'
                                                 'input = "a.{x}"\noutput = "b.{x}"\n')
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", first, "-o", fused))
    ok(cli("unfuse", fused, "-r", first, "-o", tmp_path / "ok.safetensors"))
    assert load_checkpoint_raw(tmp_path / "ok.safetensors") == load_checkpoint_raw(src)
    # the recorded group is found by its text: the same rule name in another file is not it
    other = write_rules(tmp_path / "other.toml", 'version = 1\n[[rule]]\nname = "r"\nop = "rename"\n'
                                                 'input = "c.{x}"\noutput = "b.{x}"\n')
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", fused, "-r", other, "-o", back), "every tensor it matches is one the provenance",
            "says rule 'r'", "did not make", unwritten=[back])


def test_chained_rules_files_are_undone_in_reverse_through_the_provenance(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    rules = write_rules(tmp_path / "strip.toml", STRIP)
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", src, "-r", rules, "-r", "llama-qkv", "-o", fused))
    assert "layers.1.self_attn.qkv_proj.weight" in load_checkpoint_raw(fused)
    ok(cli("unfuse", fused, "-r", rules, "-r", "llama-qkv", "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
    assert "fusectl" in metadata_of(back)


def _ones(n):
    return np.ones(n, np.float32)


def test_a_lora_adapter_is_undone_through_its_base_views_provenance(cli, fixtures_dir, tmp_path):
    """An adapter's rules bind to its base view (m.weight names): the proof reads the recorded
    base plan (lora_base); without a provenance the same unfuse -r is refused."""
    lora, config = fixtures_dir / "lora" / "llama-lora", fixtures_dir / "lora" / "llama-base" / "config.json"
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", lora, "--config", config, "-r", "llama-qkv", "-o", fused))
    ok(cli("unfuse", fused, "--config", config, "-r", "llama-qkv", "-o", back))
    restored = load_checkpoint_raw(back)
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight" in restored
    assert not any("qkv_proj" in name for name in restored)
    adapter = fused / "adapter_model.safetensors"
    with_provenance(adapter, adapter)
    guessed = tmp_path / "guessed"
    refused(cli("unfuse", fused, "--config", config, "-r", "llama-qkv", "-o", guessed),
            "rule 'attn-qkv (inverse)'", "may be a tensor the forward rule left alone", "has no fusectl provenance",
            unwritten=[guessed])
