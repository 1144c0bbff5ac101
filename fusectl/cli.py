"""The command line. The only place that turns errors into exit codes and text."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import signal
import sys

from typing import TYPE_CHECKING

import click

from .errors import CheckpointError, FusectlError, cli_vocabulary, offering, printable
from .version import __version__

if TYPE_CHECKING:
    from . import api


def _api():
    """``fusectl.api``, imported when a command needs it: ``--version`` and ``--help`` pay only
    for click (the API pulls in numpy and ml_dtypes, most of a command's start-up)."""
    from . import api

    return api

EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2
EXIT_BUG = 70  # EX_SOFTWARE


class _Terminated(BaseException):
    """SIGTERM, raised so that temporary output is removed like on any other failure. Not an
    Exception (KeyboardInterrupt is not one either): code that turns a third party's errors of
    any type into a domain error (``except Exception``) must not turn a termination into one."""


def _on_sigterm(signum, frame):
    raise _Terminated()


class FusectlGroup(click.Group):
    """Maps domain errors to ``error: ...`` on stderr and exit code 2, without a traceback."""

    def invoke(self, ctx: click.Context):
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            with cli_vocabulary():  # the library's messages name flags, not keyword arguments
                return super().invoke(ctx)
        except FusectlError as e:
            _fail(ctx, str(e))
        except _Terminated:
            _fail(ctx, "terminated; no output was written", code=143)
        except KeyboardInterrupt:
            _fail(ctx, "interrupted; no output was written", code=130)
        except BrokenPipeError:  # stdout closed early (| head): stop quietly like other tools
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(141)
        except OSError as e:
            # shutil's copies name the source first and the destination second
            name = e.filename2 if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename2 else e.filename
            where = f"{printable(str(name))}: " if name else ""
            _fail(ctx, f"{where}{e.strerror or e}; check the path, permissions and free space")
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as e:  # a bug in fusectl, never bad input: EX_SOFTWARE, as SPEC §4 says
            _fail(ctx, f"internal error: {type(e).__name__}: {printable(str(e))}; this is a bug in "
                       "fusectl, not in your input: rerun with --debug and report it with the traceback",
                  code=EXIT_BUG)


def _fail(ctx: click.Context, message: str, code: int = EXIT_BAD_INPUT):
    if _debug(ctx):
        import traceback  # only with --debug (linecache and tokenize are slow to load)

        traceback.print_exc()
    click.echo(f"error: {message}", err=True)
    ctx.exit(code)


def _debug(ctx: click.Context) -> bool:
    return bool(ctx.find_root().meta.get("fusectl.debug"))


def _set_debug(ctx, param, value):
    if value:
        ctx.find_root().meta["fusectl.debug"] = True
    return value


def _set_follow_symlinks(ctx, param, value):
    if value:
        ctx.find_root().meta["fusectl.follow_symlinks"] = True
    return value


links_option = click.option(
    "--follow-symlinks", is_flag=True, expose_value=False, callback=_set_follow_symlinks,
    help="Follow links in an input folder that lead outside it (by default only links inside the "
         "folder, or inside its Hugging Face cache repository, are followed).",
)


def _set_key(ctx, param, value):
    if value is not None:
        ctx.find_root().meta["fusectl.key"] = value
    return value


key_option = click.option(
    "--key", expose_value=False, callback=_set_key, metavar="KEY",
    help="The state dict inside a PyTorch training dict or a torch.distributed.checkpoint folder "
         "(dotted for nesting: state.model); by default the top level when it holds tensors, else "
         "'model' or the one nested dict that does.",
)


def _key() -> str | None:
    return click.get_current_context().find_root().meta.get("fusectl.key")


def _inputs() -> dict:
    """How the command line's --follow-symlinks and --key read a checkpoint, as the API's arguments."""
    return {"follow_symlinks": _follow_symlinks(), "key": _key()}


def inputs_options(fn):
    """--follow-symlinks and --key: how a command reads its checkpoint."""
    return links_option(key_option(fn))


debug_option = click.option(
    "--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
    help="Show a Python traceback on errors.",
)


def command(group, name, **kwargs):
    """A subcommand with --debug, run offering the library's messages its own options only
    (``errors.offering``: no advice names an option the command lacks)."""
    def wrap(fn):
        cmd = group.command(name, **kwargs)(debug_option(fn))
        callback, names = cmd.callback, frozenset(p.name for p in cmd.params)

        @functools.wraps(callback)
        def run_offering(*args, **options):
            with offering(names):
                return callback(*args, **options)

        cmd.callback = run_offering
        return cmd
    return wrap


@click.group(cls=FusectlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fusectl")
@debug_option
def main():
    """Re-lay out model checkpoints with declarative rules; keep tied weights tied.

    \b
    Example:
      fusectl fuse fixtures/tiny-llama-gqa -r llama-qkv -r llama-gate-up -o fused/
      fusectl unfuse fused/ -o restored/
    """


def run() -> None:
    """The ``fusectl`` command (the console script, ``python -m fusectl``): :func:`main`, then the
    process ends at once, its standard streams flushed, without tearing the interpreter down.

    Nothing is lost by it: every output a command writes is closed and fsynced before the command
    returns, every thread fusectl starts is a daemon (which a normal exit does not wait for
    either), and fusectl registers no exit handlers. The teardown it skips (freeing every module,
    unloading numpy and onnxruntime) took 45–60 ms of each ``inspect`` here and 60–90 ms of each
    ``verify``: a fifth of an ``inspect``'s time. (``main`` itself, as click's test runner calls
    it, exits as usual.)
    """
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # what sys.exit does with any other value
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed early (| head): as FusectlGroup.invoke ends it
        code = 141
    except OSError as e:  # a full disk behind a redirection: the output is not all there
        print(f"error: standard output: {e.strerror or e}; the output is incomplete", file=sys.stderr)
        code = code or EXIT_BAD_INPUT
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)


def _note(message: str) -> None:
    """Something the user should know that is not an error (stderr, even with --quiet)."""
    click.echo(f"note: {printable(message)}", err=True)


def _emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2))


def _emit(report, as_json: bool) -> None:
    """A report as its JSON (--json) or its text."""
    if as_json:
        _emit_json(report.to_json())
    else:
        click.echo(report.to_text())


def _follow_symlinks() -> bool:
    return bool(click.get_current_context().find_root().meta.get("fusectl.follow_symlinks"))


def _forward_plan(ckpt, rules, config_path, untie, adopt, param_order=None, **training) -> api.Planned:
    """Bind RULES to CKPT (a usage error without rules); ``training``: --param-order-from-model,
    --drop-optimizer and --untie-training."""
    if not rules:
        raise click.UsageError("give at least one -r RULES (a rules file or a preset name)")
    extra = {"param_order": param_order} if param_order else {}
    return _api().plan(ckpt, rules, config=config_path, untie=untie, detect_ties=adopt, **_inputs(), **extra,
                       **training)


rules_option = click.option("-r", "--rules", "rules", multiple=True, metavar="RULES",
                            help="Rules file or preset name (repeatable; applied in order).")
config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                             help="config.json for config: variables (default: the one beside CKPT).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
untie_option = click.option("--untie", is_flag=True,
                            help="Allow rules that break a tie (other members become copies).")
untie_training_option = click.option(
    "--untie-training", "untie_training", is_flag=True,
    help="Like --untie, also in a training checkpoint: each untied member gets a copy of the one optimizer "
         "state, and trains on its own gradient instead of the members' summed one (another trajectory).")
drop_option = click.option(
    "--drop-optimizer", "drop_optimizer", is_flag=True,
    help="Write a training checkpoint without its optimizer state, on purpose (a .pt output: the training "
         "dict without it, other entries kept); folds and rules the optimizer cannot follow then apply.")
to_option = click.option(
    "--to", "to", type=click.Choice(["dcp", "ds-universal", "megatron"]), default=None,
    help="Write a training checkpoint (model and optimizer) to the -o folder as a torch.distributed.checkpoint "
         "folder (dcp: dcp.load reads it on any number of ranks) or a DeepSpeed universal checkpoint "
         "(ds-universal: DeepSpeed resumes from it on any world size); or write the model (megatron-core's "
         "names) as a Megatron-LM legacy save at --tp x --pp (megatron: each rank's Adam state split like its "
         "parameters, the scheduler kept), or as a torch_dist save with --ckpt-format torch_dist.")
tp_option = click.option("--tp", "tp", type=click.IntRange(min=1), default=None, metavar="N",
                         help="With --to megatron: the tensor-parallel size (default 1).")
pp_option = click.option("--pp", "pp", type=click.IntRange(min=1), default=None, metavar="M",
                         help="With --to megatron: the pipeline-parallel size (default 1).")
ckpt_format_option = click.option(
    "--ckpt-format", "ckpt_format", type=click.Choice(["torch", "torch_dist"]), default=None,
    help="With --to megatron: Megatron-LM's checkpoint format: torch (default: legacy rank files) or torch_dist "
         "(dist_checkpointing's global tensors, which megatron-core loads at any TP and PP; the model only: "
         "a training input needs --drop-optimizer).")
ep_option = click.option("--ep", "ep", type=click.IntRange(min=1), default=None, metavar="E",
                         help="With --to megatron: the expert-parallel size of an MoE model (default 1); its experts "
                              "must divide over it.")
adopt_option = click.option("--detect-ties", "adopt", is_flag=True,
                            help="Adopt tensors with equal, non-constant content as ties.")
order_option = click.option(
    "--param-order", "param_order", type=click.Path(dir_okay=False), default=None, metavar="FILE",
    help="A JSON list of a training checkpoint's parameter names in the order its optimizer was given "
         "them ([n for n, _ in model.named_parameters()]), where the shapes do not prove it.")
model_order_option = click.option(
    "--param-order-from-model", "param_order_from_model", is_flag=True,
    help="Take that order from the model's code instead: the transformers class config.json names, "
         "built on the meta device (needs torch and transformers; never a model's own code). For a "
         "Trainer folder written to a folder, the output's order too, from the output config.json.")
write_once_option = click.option(
    "--write-ties-once", is_flag=True,
    help="Store a tie adopted over two stored tensors ([ties], --detect-ties) once, with the others "
         "as aliases. transformers and safetensors.load_model do not restore such aliases.")


@command(main, "inspect")
@inputs_options
@click.argument("ckpt", type=click.Path())
@json_option
@click.option("--detect-ties", "detect", is_flag=True,
              help="Hash every tensor and report equal ones as suspected ties (reads all data).")
@config_option
@order_option
@model_order_option
def inspect_cmd(ckpt, as_json, detect, config_path, param_order, param_order_from_model):
    """Show a checkpoint's parameters, ties and provenance (reads headers only).

    \b
    Example:
      fusectl inspect fixtures/tied-embeddings.safetensors --json
    """
    report = _api().inspect(ckpt, config=config_path, detect_ties=detect, param_order=param_order,
                            param_order_from_model=param_order_from_model, **_inputs())
    _emit(report, as_json)


@command(main, "plan")
@inputs_options
@click.argument("ckpt", type=click.Path())
@rules_option
@json_option
@untie_option
@adopt_option
@config_option
@order_option
@model_order_option
@untie_training_option
@drop_option
def plan_cmd(ckpt, rules, as_json, untie, adopt, config_path, param_order, param_order_from_model, untie_training,
             drop_optimizer):
    """Show what RULES would do to CKPT, from headers alone.

    \b
    Example:
      fusectl plan fixtures/tiny-llama-gqa -r llama-qkv --json
    """
    _emit(_forward_plan(ckpt, rules, config_path, untie, adopt, param_order,
                        param_order_from_model=param_order_from_model, untie_training=untie_training,
                        drop_optimizer=drop_optimizer), as_json)


class SizeType(click.ParamType):
    """``--max-shard-size 5GB`` → 5_000_000_000: decimal units as Hugging Face uses them, KiB,
    MiB, GiB, TiB binary; a bad value is an ``error:`` naming the option (exit 2).

    >>> SizeType().convert("500MB", None, None), SizeType().convert("1GiB", None, None)
    (500000000, 1073741824)
    """

    name = "SIZE"
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in self.units:
            self._bad(f"--max-shard-size {value!r}: write a size such as 5GB, 500MB or 2GiB", param, ctx)
        size = int(float(m.group(1)) * self.units[m.group(2).upper()])
        if size <= 0:
            self._bad(f"--max-shard-size {value!r} must be positive", param, ctx)
        return size

    def _bad(self, message, param, ctx):
        if ctx is None:
            self.fail(message, param, ctx)
        _fail(ctx, message)


output_options = [
    click.option("-o", "--output", "out", required=True, type=click.Path(),
                 help="Output: FILE.safetensors, FILE.npz, or a folder (Hugging Face layout)."),
    click.option("--max-shard-size", type=SizeType(), default=None,
                 help="Cut a folder output into shards of at most this size (e.g. 5GB). "
                      "Default: keep a sharded input's shards, else 5GB."),
    click.option("--force", is_flag=True, help="Replace an existing output."),
    click.option("--quiet", is_flag=True, help="No progress on stderr."),
]


def with_output_options(fn):
    for option in reversed(output_options):
        fn = option(fn)
    return fn


@command(main, "fuse")
@inputs_options
@click.argument("ckpt", type=click.Path())
@rules_option
@with_output_options
@untie_option
@adopt_option
@write_once_option
@config_option
@json_option
@order_option
@click.option("--param-order-out", "param_order_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="For a training checkpoint written whole (a training dict to -o FILE.pt, a Trainer folder to a "
                   "folder): a JSON list of the fused model's parameters in its order "
                   "([n for n, _ in new_model.named_parameters()]); the optimizer's ids follow it.")
@model_order_option
@untie_training_option
@drop_option
@to_option
@tp_option
@pp_option
@ep_option
@ckpt_format_option
def fuse_cmd(ckpt, rules, out, max_shard_size, force, quiet, untie, adopt, write_ties_once, config_path, as_json,
             param_order, param_order_out, param_order_from_model, untie_training, drop_optimizer, to, tp, pp, ep,
             ckpt_format):
    """Apply RULES to CKPT and write the result with its provenance.

    \b
    Example:
      fusectl fuse fixtures/tiny-llama-gqa -r llama-qkv -r llama-gate-up -o fused/
    """
    if not rules:
        raise click.UsageError("give at least one -r RULES (a rules file or a preset name)")
    _emit(_api().fuse(ckpt, rules, out, max_shard_size=max_shard_size, force=force, untie=untie, detect_ties=adopt,
                   write_ties_once=write_ties_once, config=config_path, **_inputs(),
                   progress=False if quiet else None, on_note=_note, param_order=param_order,
                   param_order_out=param_order_out, param_order_from_model=param_order_from_model,
                   untie_training=untie_training, drop_optimizer=drop_optimizer, to=to, tp=tp, pp=pp, ep=ep,
                   ckpt_format=ckpt_format), as_json)


@command(main, "unfuse")
@inputs_options
@click.argument("ckpt", type=click.Path())
@rules_option
@with_output_options
@untie_option
@write_once_option
@config_option
@json_option
@untie_training_option
@drop_option
@order_option
@to_option
@tp_option
@pp_option
@ep_option
@ckpt_format_option
def unfuse_cmd(ckpt, rules, out, max_shard_size, force, quiet, untie, write_ties_once, config_path, as_json,
               untie_training, drop_optimizer, param_order, to, tp, pp, ep, ckpt_format):
    """Undo a fuse: invert CKPT's recorded provenance, or the given RULES in reverse order.

    \b
    Example:
      fusectl unfuse fused/ -o restored/
    """
    _emit(_api().unfuse(ckpt, out, rules, max_shard_size=max_shard_size, force=force, untie=untie,
                     write_ties_once=write_ties_once, config=config_path, **_inputs(),
                     progress=False if quiet else None, on_note=_note, untie_training=untie_training,
                     drop_optimizer=drop_optimizer, param_order=param_order, to=to, tp=tp, pp=pp, ep=ep,
                     ckpt_format=ckpt_format), as_json)


@command(main, "convert")
@inputs_options
@click.argument("ckpt", type=click.Path())
@with_output_options
@write_once_option
@config_option
@json_option
@order_option
@drop_option
@to_option
@tp_option
@pp_option
@ep_option
@ckpt_format_option
def convert_cmd(ckpt, out, max_shard_size, force, quiet, write_ties_once, config_path, as_json, param_order,
                drop_optimizer, to, tp, pp, ep, ckpt_format):
    """Write CKPT in another format with no rules (.safetensors, .npz or a folder).

    Reads every format fusectl reads: a PyTorch file or pytorch_model*.bin folder (safely,
    without torch), an ONNX model's initializers, safetensors, npz. Tensors stored as file
    ranges are copied without decoding; shared storages and ties are written once. A training
    dict written to a PyTorch file keeps its optimizer state and every other entry; with --to,
    a training checkpoint is written whole to a DCP or DeepSpeed universal folder, or
    (--to megatron --tp N --pp M) a model in megatron-core's names as Megatron-LM rank files
    (--ckpt-format torch_dist: as a dist_checkpointing save).

    \b
    Example:
      fusectl convert training.pth --key model_state_dict -o model.safetensors
    """
    _emit(_api().convert(ckpt, out, max_shard_size=max_shard_size, force=force, write_ties_once=write_ties_once,
                      config=config_path, **_inputs(), progress=False if quiet else None, on_note=_note,
                      param_order=param_order, drop_optimizer=drop_optimizer, to=to, tp=tp, pp=pp, ep=ep,
                      ckpt_format=ckpt_format), as_json)


@command(main, "map")
@inputs_options
@click.argument("ckpt", type=click.Path())
@click.argument("other", metavar="GRAPH.onnx|OTHER", type=click.Path())
@json_option
@config_option
def map_cmd(ckpt, other, as_json, config_path):
    """Pair CKPT's names with GRAPH's initializers, or with the names of OTHER, another
    checkpoint of the same model.

    A graph: by name (allowing one common prefix), then by equal content, then by equal
    transposed content (exporters fold Linear weights into anonymous transposed initializers).
    A checkpoint (a Gluon save_parameters file and its export): by name where the names agree
    (after MXNet's arg:/aux: and one common prefix), then by content equal and unique on both
    sides. Tensors of equal content that nothing tells apart are listed as ambiguous and never
    paired: the report is printed, then an error (exit 2).

    \b
    Example:
      fusectl map fixtures/onnx/bert/model.safetensors fixtures/onnx/bert/model.onnx
      fusectl map net.params net-0000.params
    """
    api = _api()
    c = api.open_input(ckpt, config=config_path, **_inputs())
    if not os.fspath(other).endswith(".onnx"):
        o = api.open_input(other, follow_symlinks=_follow_symlinks())
        result = api.map_names(c, o)
        if as_json:
            _emit_json(result.to_json())
        else:
            click.echo(result.to_text(ckpt, other, (len(c.table.names()), len(o.table.names()))))
        if result.ambiguous:
            first = result.ambiguous[0]
            raise CheckpointError(
                f"{len(result.ambiguous)} group(s) of tensors hold equal bytes that nothing tells apart, so they are "
                f"not paired: {', '.join(first.checkpoint)} in {ckpt} and {', '.join(first.other)} in {other} "
                f"({first.dtype} {list(first.shape)}){' and more' if len(result.ambiguous) > 1 else ''}; pair "
                "those by hand (their names say which is which, the bytes cannot)")
        return
    result = api.map_names(c, other)
    if as_json:
        _emit_json(result.to_json())
    else:
        click.echo(api.name_map_text(result, ckpt, other, len(c.table.names())))


@command(main, "export")
@inputs_options
@click.argument("ckpt", type=click.Path())
@click.option("--graph", "graph", required=True, type=click.Path(dir_okay=False),
              help="ONNX graph exported from the model with the unfused layout.")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Output .onnx.")
@click.option("--force", is_flag=True, help="Replace an existing output.")
@json_option
@config_option
def export_cmd(ckpt, graph, out, force, as_json, config_path):
    """Write GRAPH rewritten to take CKPT's (fused) parameters as its initializers.

    Every weight GRAPH holds (initializers and Constant nodes, also inside If/Loop/Scan
    bodies) is replaced by the checkpoint tensor it equals, or the export is refused; the
    graph's own tensors it keeps (shapes, scalars, tables) are listed (--json:
    kept_constants). MatMul consumers of the parts of a fused weight that share an input
    become one MatMul (+ bias Add) and a Split; Gemm consumers likewise become one Gemm and
    a Split when their alpha, beta and transA are equal (transB 0 or 1) and their biases
    are the parts of one fused bias, 1-D, or absent. Other groups stay as they are and are
    listed (--json: not_fused). weight_norm/spectral_norm subgraphs become the folded
    initializer; Conv + BatchNormalization becomes one Conv; tied parameters are stored
    once. Every float tensor of CKPT must end up in the graph, or the export is refused
    naming it (integer ones the graph does not read are listed: --json unused). A GRAPH
    below opset 13 is converted to 13 first. OUT must end in .onnx.

    \b
    Example:
      fusectl fuse fixtures/onnx/bert -r bert-qkv -o bert-fused/
      fusectl export bert-fused/ --graph fixtures/onnx/bert/model.onnx -o bert-fused.onnx
      fusectl verify fixtures/onnx/bert/model.onnx bert-fused.onnx --inputs fixtures/onnx/bert/io.npz
    """
    # opened first: a missing checkpoint is named before a bad output name
    _emit(_api().export(_api().open_input(ckpt, config=config_path, **_inputs()), graph, out, force=force,
                     on_note=_note), as_json)


class _NamedSizesType(click.ParamType):
    """``NAME=...`` with sizes from 1 to 2**31-1; a bad value is a usage error (exit 2) naming the option."""

    max_size = 2**31 - 1
    example = ""

    def parse(self, name: str, sizes: str):
        raise NotImplementedError

    def size(self, text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= self.max_size:
            raise ValueError(f"{text!r} is not a size")
        return int(text)

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):  # already converted (a default)
            return value
        option = param.opts[0] if param is not None and param.opts else self.name
        try:
            name, sep, sizes = value.partition("=")
            if not sep or not name:
                raise ValueError("no NAME=")
            return name, self.parse(name, sizes)
        except ValueError as e:
            message = (f"{option} {value!r}: {e}; write {self.name} with whole-number sizes from 1 to "
                       f"{self.max_size}, for example {self.example}")
            if ctx is None:
                self.fail(message, param, ctx)
            _fail(ctx, message)


class InputShapeType(_NamedSizesType):
    """``--input NAME=2x16`` -> ("NAME", (2, 16)); ``NAME=`` is a 0-d (scalar) input."""

    name = "NAME=D0xD1x..."
    example = "input_ids=2x16"

    def parse(self, name, sizes):
        return tuple(self.size(d) for d in sizes.lower().split("x")) if sizes else ()


class DimType(_NamedSizesType):
    """``--dim batch=2`` -> ("batch", 2)."""

    name = "NAME=SIZE"
    example = "batch=2"

    def parse(self, name, sizes):
        return self.size(sizes)


class ToleranceType(click.ParamType):
    """``--atol 1e-4`` -> 0.0001: finite and >= 0 (NaN or inf would pass anything), else exit 2."""

    name = "TOLERANCE"

    def convert(self, value, param, ctx):
        if isinstance(value, float):  # already converted
            return value
        try:
            return _api().check_tolerance(param.opts[0] if param is not None else "tolerance", value)
        except FusectlError as e:
            if ctx is None:
                self.fail(str(e), param, ctx)
            _fail(ctx, str(e))


class OutputToleranceType(click.ParamType):
    """``--tol logits=1e-4,1e-3`` -> ("logits", (0.0001, 0.001)); ``--tol logits=1e-4`` keeps the
    global (or dtype's) rtol: ("logits", (0.0001, None)). The name is what comes before the last "="."""

    name = "OUTPUT=ATOL[,RTOL]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):  # already converted
            return value
        output, sep, numbers = str(value).rpartition("=")
        try:
            if not sep or not output:
                raise FusectlError(f"--tol {printable(str(value))!r}: write OUTPUT=ATOL or OUTPUT=ATOL,RTOL, "
                                   "for example logits=1e-4,1e-3")
            atol, comma, rtol = numbers.partition(",")
            where = f"--tol {printable(output)}"
            return output, (_api().check_tolerance(where, atol),
                            _api().check_tolerance(where, rtol) if comma else None)
        except FusectlError as e:
            if ctx is None:
                self.fail(str(e), param, ctx)
            _fail(ctx, str(e))


class SeedType(click.ParamType):
    """``--seed N``: a whole number >= 0, as numpy seeds are (a negative one is refused, not mapped
    onto another seed, so that each seed in a report names one set of inputs)."""

    name = "N"

    def convert(self, value, param, ctx):
        if isinstance(value, int):  # already converted (the default)
            return _api().check_seed(value)
        text = str(value).strip()
        try:
            if not text.lstrip("+-").isdigit() or not text.isascii():
                raise FusectlError(f"--seed {value!r}: give a whole number >= 0")
            return _api().check_seed(int(text))
        except (FusectlError, ValueError) as e:  # ValueError: more digits than Python converts
            message = str(e) if isinstance(e, FusectlError) else f"--seed: {len(text)} digits; give a smaller seed"
            if ctx is None:
                self.fail(message, param, ctx)
            _fail(ctx, message)


@command(main, "verify")
@inputs_options
@click.argument("reference", type=click.Path())
@click.argument("candidate", type=click.Path())
@rules_option
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime provider; cuda must really run on CUDA.")
@click.option("--rtol", type=ToleranceType(), default=None,
              help="Relative tolerance, finite and >= 0 (default by dtype: fp32 1e-5, fp16 1e-3, bf16 1e-2).")
@click.option("--atol", type=ToleranceType(), default=None,
              help="Absolute tolerance, finite and >= 0 (default by dtype, as --rtol).")
@click.option("--input", "input_shapes", multiple=True, type=InputShapeType(), metavar="NAME=D0xD1x...",
              help="Whole shape of one model input; its named dimensions apply to the other inputs too (repeatable).")
@click.option("--dim", "dims", multiple=True, type=DimType(),
              help="Size of a named dynamic dimension (dim_param) in every input that uses it (repeatable; "
                   "default 2 for a leading batch axis, else 16).")
@click.option("--inputs", "inputs_file", type=click.Path(), default=None,
              help="Model inputs as named arrays in an .npz (default: seeded random).")
@click.option("--seed", type=SeedType(), default=0, show_default=True, help="Seed of the random inputs (>= 0).")
@click.option("--tol", "tolerances", multiple=True, type=OutputToleranceType(),
              help="Tolerances of one output, instead of --atol/--rtol (repeatable; RTOL left out: the global one).")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run N seeded input sets (--seed, --seed+1, ...); the report gives the pass rate and the worst run.")
@click.option("--save-inputs", "save_inputs", type=click.Path(dir_okay=False), default=None, metavar="FILE.npz",
              help="Write the inputs of the first failing run here; --inputs FILE.npz reproduces it.")
@click.option("--localize/--no-localize", default=None,
              help="Name the first node whose output differs, comparing intermediates a segment at a time "
                   "(default: when an output fails).")
@click.option("--report", "report_path", type=click.Path(), default=None,
              help="Write the JSON report here (never over an input).")
@click.option("--junit", "junit_path", type=click.Path(), default=None,
              help="Write JUnit XML here, for CI (never over an input).")
@click.option("--html", "html_path", type=click.Path(), default=None, metavar="FILE.html",
              help="Write the report as one self-contained HTML page here: failing checks first, "
                   "statistics, error histograms (never over an input).")
@config_option
@order_option
@click.option("--param-order-out", "param_order_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="As --param-order, for CANDIDATE's optimizer (the fused model's named_parameters() order), "
                   "where the shapes do not prove it.")
def verify_cmd(reference, candidate, rules, provider, rtol, atol, input_shapes, dims, inputs_file, seed,
               tolerances, runs, save_inputs, localize, report_path, junit_path, html_path, config_path,
               param_order, param_order_out):
    """Prove CANDIDATE computes what REFERENCE computes; exit 1 when it does not.

    Two .onnx models: both run on onnxruntime with the same inputs and every output is
    compared; when one fails (or with --localize), the first node whose output differs is named.
    Two checkpoints: the candidate's provenance (or -r RULES) is replayed on the
    reference and compared tensor by tensor, the inverse is checked, ties are checked, and each
    step kind runs once per shape as a small onnxruntime computation. A training checkpoint's
    optimizer state is replayed too (each state tensor against the plan's steps on the
    reference's, numbers and param groups equal); --param-order and --param-order-out give the
    two optimizers' parameter orders where the shapes do not prove them.

    \b
    Example:
      fusectl verify fixtures/tiny-llama-gqa fused/ --junit verify.xml
      fusectl verify original.onnx fused.onnx --dim batch=2 --dim sequence=16 --report verify.json
      fusectl verify original.onnx fused.onnx --runs 8 --tol logits=1e-4 --save-inputs failing.npz
      fusectl verify original.onnx fused.onnx --localize --report verify.json
      fusectl verify original.onnx fused.onnx --report verify.json --html verify.html
    """
    ctx = click.get_current_context()
    parsed = {}
    for option, pairs in (("--input", input_shapes), ("--dim", dims), ("--tol", tolerances)):
        parsed[option] = {}
        for name, value in pairs:
            if parsed[option].get(name, value) != value:
                what = "tolerances" if option == "--tol" else "sizes"
                _fail(ctx, f"{option} {printable(name)} is given twice with different {what}; give it once")
            parsed[option][name] = value
    report = _api().verify(reference, candidate, rules=rules, provider=provider, atol=atol, rtol=rtol,
                        shapes=parsed["--input"], dims=parsed["--dim"], inputs=inputs_file, seed=seed,
                        config=config_path, **_inputs(), report=report_path, junit=junit_path, html=html_path,
                        on_note=_note,
                        param_order=param_order, param_order_out=param_order_out,
                        output_checks=_api().OutputChecks(tolerances=parsed["--tol"], runs=runs,
                                                          save_inputs=save_inputs, localize=localize))
    click.echo(report.to_text())
    if not report.passed:
        ctx.exit(EXIT_DIFFERENT)


@main.group("rules", cls=FusectlGroup)
def rules_group():
    """List and show the presets shipped with fusectl."""


@command(rules_group, "list")
def rules_list():
    """Name each preset with its one-line description."""
    presets = _api().presets()
    width = max(len(n) for n in presets)
    for name, description in presets.items():
        click.echo(f"{name:<{width}}  {description}")


@command(rules_group, "show")
@click.argument("name")
def rules_show(name):
    """Print a preset's rules file."""
    click.echo(_api().preset_text(name), nl=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
