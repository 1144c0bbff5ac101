"""``fusectl.errors``: how messages name options (the caller's vocabulary), and escaping."""

from __future__ import annotations

import inspect as pyinspect
import threading

import click
import pytest

from fusectl import api
from fusectl.cli import main
from fusectl.errors import OPTIONS, cli_vocabulary, option, option_name, printable, quote, speaking_cli


@pytest.mark.parametrize("name,value,cli,api_words", [
    ("untie", None, "--untie", "untie=True"),
    ("detect_ties", None, "--detect-ties", "detect_ties=True"),
    ("write_ties_once", None, "--write-ties-once", "write_ties_once=True"),
    ("follow_symlinks", None, "--follow-symlinks", "follow_symlinks=True"),
    ("force", None, "--force", "force=True"),
    ("rules", "fp8-dequant", "-r fp8-dequant", 'rules=["fp8-dequant"]'),
    ("rules", None, "-r RULES", "rules=[...]"),
    ("config", None, "--config FILE", "config=..."),
    ("config", "c.json", "--config c.json", 'config="c.json"'),
    ("key", "state.model", "--key state.model", 'key="state.model"'),
    ("max_shard_size", 5_000_000_000, "--max-shard-size 5000000000", "max_shard_size=5000000000"),
    ("atol", 1e-4, "--atol 0.0001", "atol=0.0001"),
    ("dims", None, "--dim NAME=SIZE", "dims=[...]"),
    ("shapes", None, "--input NAME=D0xD1...", "shapes=[...]"),
    ("inputs", None, "--inputs FILE", "inputs=..."),
    ("report", None, "--report FILE", "report=..."),
])
def test_option_speaks_the_callers_language(name, value, cli, api_words):
    assert option(name, value) == api_words
    with cli_vocabulary():
        assert option(name, value) == cli


def test_option_name_is_the_flag_or_the_keyword():
    assert [option_name(n) for n in ("key", "dims", "report")] == ["key", "dims", "report"]
    with cli_vocabulary():
        assert [option_name(n) for n in ("key", "dims", "report")] == ["--key", "--dim", "--report"]


def test_values_read_from_files_are_escaped():
    evil = "a" + chr(27) + "[31m"
    assert option("rules", evil) == 'rules=["a\\u001b[31m"]'
    assert chr(27) not in option("rules", evil)
    with cli_vocabulary():
        assert option("rules", evil) == "-r " + printable(evil)
        assert chr(27) not in option("rules", evil)


def test_an_unknown_option_is_a_bug_not_a_message():
    with pytest.raises(KeyError):
        option("no_such_option")
    with pytest.raises(KeyError):
        option_name("no_such_option")


def test_the_vocabulary_ends_with_its_block_even_on_an_error():
    assert not speaking_cli()
    with pytest.raises(RuntimeError), cli_vocabulary():
        assert speaking_cli()
        with cli_vocabulary():  # nested: still the CLI's
            assert option("untie") == "--untie"
        assert option("untie") == "--untie"
        raise RuntimeError
    assert not speaking_cli() and option("untie") == "untie=True"


def test_the_vocabulary_is_per_thread():
    seen = []
    with cli_vocabulary():
        thread = threading.Thread(target=lambda: seen.append(option("untie")))
        thread.start()
        thread.join()
        assert option("untie") == "--untie"
    assert seen == ["untie=True"]


def _cli_options() -> set[str]:
    """Every option string of every fusectl command."""
    found: set[str] = set()

    def walk(command: click.Command):
        for param in command.params:
            found.update(getattr(param, "opts", []))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(main)
    return found


def _api_keywords() -> set[str]:
    """Every parameter of the API's functions (``out`` and ``graph`` are positional there)."""
    return {p for name in api.__all__ if callable(getattr(api, name)) and not isinstance(getattr(api, name), type)
            for p in pyinspect.signature(getattr(api, name)).parameters}


def test_every_row_names_a_real_flag_and_a_real_keyword():
    flags, keywords = _cli_options(), _api_keywords()
    for name, (flag, _, _) in OPTIONS.items():
        assert flag in flags, f"{name}: {flag} is no option of fusectl"
        assert name in keywords, f"{name} is no keyword of fusectl's API"


def test_printable_and_quote_escape_control_characters():
    assert printable("tab\there") == "tab\\there"
    assert printable("plain.name") == "plain.name"
    assert quote("it's") == "'it\\'s'"


def test_the_cli_runner_fails_a_message_naming_an_option_the_command_lacks():
    # conftest.run_cli asserts this on every CLI test: a message's advice must be followable as it is
    # (issue 28: unfuse once asked for --param-order, which it did not have)
    from conftest import unknown_options

    assert unknown_options(["unfuse", "f.pt", "-o", "o.pt"], "error: give --param-order-out FILE") == \
        ["--param-order-out"]
    assert unknown_options(["unfuse", "f.pt"], "error: give --param-order FILE, or pass --drop-optimizer") == []
    assert unknown_options(["--debug", "plan", "x"], "error: ... --untie, try --help") == []
    # a whole command spelled out is another command's: its options are its own
    assert unknown_options(["verify", "a", "b"], "make one with `fusectl export a --graph g -o o.onnx`") == []
    assert unknown_options(["rules", "show", "x"], "error: --force") == ["--force"]
