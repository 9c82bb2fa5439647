"""mgpu-cluster: the command line, a thin layer over the launcher's modules."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from launcher.errors import MgpuError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: rich's markdown and pygments cost ~0.1 s per start
    help="Launch and orchestrate multi-worker TensorFlow training from one cluster.toml.",
)

SpecArg = typer.Argument(..., help="The cluster spec (TOML).", show_default=False)
RunArg = typer.Argument(None, help="Run id; the latest run when left out.", show_default=False)


@app.command()
def check(spec: Path = SpecArg):
    """Validate SPEC and check every host and port; exit 0 when all pass, 2 otherwise."""
    from launcher import up as upmod

    upmod.check(spec)


@app.command("tf-config")
def tf_config(
    spec: Path = SpecArg,
    task: Optional[int] = typer.Option(None, "--task", help="Task index."),
    all_: bool = typer.Option(False, "--all", help="Every task's TF_CONFIG."),
):
    """Print the TF_CONFIG of one task (or of all) as JSON."""
    from launcher.errors import SpecError
    from launcher.spec import load_spec
    from launcher.tfconfig import tf_config as build

    cluster = load_spec(spec)
    if all_ == (task is not None):
        raise SpecError("Give exactly one of --task N or --all.")
    if all_:
        typer.echo(json.dumps([build(cluster, i) for i in range(cluster.num_workers)], indent=2))
        return
    if not 0 <= task < cluster.num_workers:
        raise SpecError(f"--task {task}: {spec} has tasks 0..{cluster.num_workers - 1}.")
    typer.echo(json.dumps(build(cluster, task), indent=2))


@app.command()
def schema():
    """Print the JSON Schema of cluster.toml (for editors)."""
    from launcher.spec import ClusterSpec

    typer.echo(json.dumps(ClusterSpec.model_json_schema(), indent=2))


@app.command()
def up(
    spec: Path = SpecArg,
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once every task runs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what each task would run; start nothing."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the launcher's own lines."),
    run_id: Optional[str] = typer.Option(None, "--run-id", hidden=True),
):
    """Check SPEC, start every task, stream their output, stop all on the first failure."""
    from launcher import up as upmod

    upmod.up(spec, detach=detach, dry_run=dry_run, quiet=quiet, run_id=run_id)


@app.command()
def status(
    run: Optional[str] = RunArg,
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s until the run ends."),
    probe: bool = typer.Option(False, "--probe", help="Ask every host now (GPU use too), not the launcher's record."),
):
    """Show every task of a run: state, progress, heartbeat, CPU and memory."""
    from launcher import runs

    runs.status(run, as_json=as_json, watch=watch, probe=probe)


@app.command()
def logs(
    run: Optional[str] = RunArg,
    task: Optional[int] = typer.Option(None, "--task", help="Only this task."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    tail: Optional[int] = typer.Option(None, "--tail", help="Only the last K lines."),
):
    """Print the workers' logs of a run."""
    from launcher import runs

    runs.logs(run, task=task, follow=follow, tail=tail)


@app.command()
def down(run: Optional[str] = RunArg):
    """Stop every task of a run (safe to repeat)."""
    from launcher import runs

    runs.down(run)


def main() -> None:
    try:
        app(standalone_mode=False)
    except MgpuError as exc:
        from launcher.output import Output

        Output().error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise
