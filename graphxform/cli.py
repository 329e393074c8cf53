"""The `graphxform` command. Errors are one line on stderr and a non-zero exit; --debug shows
the traceback."""

from __future__ import annotations

import json
import os
import sys
import traceback

import click

from graphxform.errors import GraphxformError

EXIT_ERROR = 1
debug_option = click.option("--debug", is_flag=True, help="Show the Python traceback on errors.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphxform")
def cli():
    """Turn a single-device TensorFlow training graph (model.meta) into a distributed one, run
    it, check it trains the same, and draw what changed."""


def _analysis(path, train_op=None):
    from graphxform import metagraph, training
    ir = metagraph.load(path)
    return ir, training.analyze(ir, train_op=train_op)


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@click.option("--train-op", help="Name of the train op when the graph has no 'train_op' collection.")
@debug_option
def inspect(model, as_json, train_op, debug):
    """Show what a training graph holds: variables, updates, gradients, slots, inputs."""
    from graphxform import report
    ir, tg = _analysis(model, train_op)
    doc = report.inspect_document(ir, tg)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(report.inspect_text(doc))


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, help="OUT.dot, OUT.svg, OUT.png or OUT.pdf.")
@click.option("--depth", default=2, show_default=True, type=click.IntRange(min=1),
              help="Name-scope levels drawn before collapsing into one box.")
@click.option("--scope", default="", help="Draw only nodes under this name scope.")
@click.option("--color", "color_by", type=click.Choice(["device", "pass"]), default="device",
              show_default=True, help="Colour nodes by device or by the pass that created them.")
@debug_option
def viz(model, output, depth, scope, color_by, debug):
    """Draw a graph (collapsed name scopes, coloured by device)."""
    from graphxform import metagraph, viz as viz_mod
    ir = metagraph.load(model)
    metagraph.check_output_path(output, model)
    note = viz_mod.write(ir, output, depth=depth, scope=scope, color_by=color_by)
    click.echo(note or f"wrote {output}", err=bool(note))


def _import_tensorflow_quietly(debug: bool) -> None:
    """TF's native libraries print start-up chatter straight to fd 2; keep it off the terminal
    so an error stays one line (``--debug`` shows everything)."""
    if debug:
        import tensorflow  # noqa: F401
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def main(argv=None):
    """Entry point: run the CLI with one-line errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if not {"-h", "--help", "--version"} & set(argv) and argv:
        _import_tensorflow_quietly(debug)
    try:
        cli.main(args=argv, prog_name="graphxform", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("graphxform: aborted", err=True)
        sys.exit(EXIT_ERROR)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except GraphxformError as e:
        if debug:
            traceback.print_exc()
        click.echo(f"graphxform: error: {e}", err=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        click.echo("graphxform: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a bug: still one line unless --debug
        if debug:
            traceback.print_exc()
        click.echo(f"graphxform: internal error: {type(e).__name__}: {e} (rerun with --debug "
                   "for the traceback)", err=True)
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
