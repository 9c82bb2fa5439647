"""mgpu-cluster: the command line, a thin layer over the launcher's modules."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, TypeVar, runtime_checkable

import typer
from typer.core import TyperCommand, TyperGroup

from launcher.errors import MgpuError

if TYPE_CHECKING:  # typer's own copy of click: what its commands are given (typer.Context is a subclass)
    from typer._click import Context, HelpFormatter

ABOUT = ("Launch and orchestrate multi-worker training from one cluster.toml: TensorFlow (MultiWorkerMirroredStrategy) "
         "or Keras 3 on JAX.")


class Group(TyperGroup):
    """The command list gives each command's first paragraph whole, wrapped (typer cuts it at '...')."""

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        rows = [(name, (cmd.help or "").split("\n\n")[0].replace("\n", " ").strip())
                for name in self.list_commands(ctx) for cmd in [self.get_command(ctx, name)]
                if cmd is not None and not cmd.hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


class Command(TyperCommand):
    """Usage names arguments as their help does (SPEC, not typer's {SPEC}); a flag with a metavar shows it
    (`--resume [RUN]`, whose run id comes as an extra argument)."""

    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", p) for p in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        args: list[tuple[str, str]] = []
        opts: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            row = param.get_help_record(ctx)
            if row is None:
                continue
            if param.param_type_name == "argument":  # its name alone, as in the usage (no "<path>")
                args.append((f"{param.metavar or param.name.upper()}{'...' if param.nargs != 1 else ''}", row[1]))
            else:
                opts.append((f"{row[0]} {param.metavar}", row[1]) if getattr(param, "is_flag", False)
                            and param.metavar else row)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,  # plain help: rich's markdown and pygments cost ~0.1 s per start
    help=ABOUT,
)


F = TypeVar("F", bound=Callable[..., Any])


def command(name: str | None = None, *,
            context_settings: dict[str, object] | None = None) -> Callable[[F], F]:
    return app.command(name, cls=Command, context_settings=context_settings)


SpecArg = typer.Argument(..., help="The cluster spec (TOML).", show_default=False, metavar="SPEC")
RunArg = typer.Argument(None, help="Run id; left out, the newest run that did not end in its preflight ('ls' "
                        "lists them).", show_default=False, metavar="RUN")
TaskOpt = typer.Option(None, "--task", help="Only this task.", metavar="N")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"mgpu-cluster {version('mgpu-cluster')}")
        raise typer.Exit()


@app.callback()
def _options(_: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                    help="Print the version and exit.")) -> None:
    """Launch and orchestrate multi-worker training from one cluster.toml: TensorFlow (MultiWorkerMirroredStrategy)
    or Keras 3 on JAX."""


_said: list[str] = []  # which run a command without a run id took, said once it succeeded


def _which(run: str | None) -> str:
    """The run a command acts on. Without a run id, which one it took is said on stderr (stdout may be JSON)
    when the command succeeds; a failure's paragraph names the run itself, and stays one paragraph."""
    from launcher.commands.listing import choose

    chosen = choose(run)
    if chosen.said:
        _said.append(f"mgpu-cluster | {chosen.said}")
    return chosen.run_id


@command()
def check(spec: Path = SpecArg,
          as_json: bool = typer.Option(False, "--json", help="One JSON object: each task's problems and the links' "
                                       "matrix.")) -> None:
    """Validate SPEC and check every host and port, the entrypoint imported on each, then measure the link
    between every two hosts and name the slow ones; exit 0 when all checks pass, 2 otherwise.

    It starts no training, but copies the `sync` files to each remote host's workdir, creating the workdir where
    it is missing, as up does."""
    from launcher.commands import up as upmod

    upmod.check(spec, as_json=as_json)

@command(context_settings={"allow_extra_args": True})
def up(
    ctx: typer.Context,
    spec: Path = SpecArg,
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once every task runs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what each task would run; start nothing."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the launcher's own lines and each epoch's line."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also TensorFlow's C++ start-up lines."),
    resume: bool = typer.Option(False, "--resume", metavar="[RUN]", help="Go on from the checkpoint of run RUN, "
                                "stopped or failed (left out: this spec's newest run); the spec must be as that run "
                                "had it, and the training gets that run's arguments unless others follow --."),
    run_id: Optional[str] = typer.Option(None, "--run-id", hidden=True),
) -> None:
    """Check SPEC, start every task, stream their output, stop all on the first failure. The training's own
    arguments go after --: up SPEC -- --epochs 3."""
    from launcher.commands import up as upmod
    from launcher.errors import SpecError

    dashes = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    after = min(len(ctx.args), len(sys.argv) - dashes - 1)  # the extra arguments that came after --
    before, args = ctx.args[:len(ctx.args) - after], ctx.args[len(ctx.args) - after:]
    if len(before) > int(resume):
        raise SpecError(f"up: unexpected argument(s) {' '.join(before)!r}; the training's own arguments go "
                        "after --: mgpu-cluster up SPEC -- --epochs 3")
    upmod.up(spec, detach=detach, dry_run=dry_run, quiet=quiet, verbose=verbose, run_id=run_id,
             resume=(before[0] if before else "") if resume else None, args=args)

@command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="One JSON list.")) -> None:
    """List the runs recorded on this machine, newest first: state, engine, tasks, start, duration, spec."""
    from launcher.commands import listing

    listing.ls(as_json=as_json)


@command()
def status(
    run: Optional[str] = RunArg,
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s until the run ends."),
    probe: bool = typer.Option(False, "--probe", help="Ask every host now (GPU use too), not the launcher's record."),
) -> None:
    """Show every task of a run: state, progress, heartbeat, CPU and memory."""
    from launcher.commands import recorded

    with _follower(watch):
        recorded.status(_which(run), as_json=as_json, watch=watch, probe=probe)

@command()
def logs(
    run: Optional[str] = RunArg,
    task: Optional[int] = TaskOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    tail: Optional[int] = typer.Option(None, "--tail", "-n", help="Only the last K lines of each task.",
                                       metavar="K", min=0),
) -> None:
    """Print the workers' logs of a run."""
    from launcher.commands import recorded

    with _follower(follow):
        recorded.logs(_which(run), task=task, follow=follow, tail=tail)

@contextlib.contextmanager
def _follower(following: bool) -> Iterator[None]:
    """Ctrl-C is how one leaves a follower (`logs -f`, `status --watch`): exit 0, nothing said, as `kubectl logs -f`."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if not following or exc.args[:1] not in ((), ("SIGINT",)):
            raise


@command()
def stacks(
    run: Optional[str] = RunArg,
    task: Optional[int] = TaskOpt,
) -> None:
    """Print the Python stacks of every live task (py-spy on its host); exit 1 naming tasks without."""
    from launcher.diagnose import commands

    commands.stacks(_which(run), task=task)

@command()
def report(
    run: Optional[str] = RunArg,
    out: Optional[str] = typer.Option(None, "--output", "-o", metavar="PNG",
                                      help="The PNG to write (default: report.png in the run's folder)."),
) -> None:
    """Draw one PNG of a run: samples/s, loss and metrics per epoch, step time, attempts and their reasons, phases
    (needs matplotlib); exit 2 for a run its preflight refused."""
    from launcher.diagnose import commands
    from launcher.commands.paths import output_file

    path = output_file(out, "-o", "report.png")
    commands.report(_which(run), path)


@command()
def dashboard(
    port: int = typer.Option(8477, "--port", help="The port to serve on.", metavar="PORT", min=0, max=65535),
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDRESS",
                             help="The address to serve on; another than loopback asks for the token it prints."),
) -> None:
    """Serve a live page of every run and GET /metrics for Prometheus, read-only (needs the dashboard extra)."""
    from launcher.dashboard.serve import serve

    serve(host, port)


@command()
def down(run: Optional[str] = RunArg) -> None:
    """Stop every task of a run (safe to repeat)."""
    from launcher.commands import recorded

    recorded.down(_which(run))

@command()
def fetch(
    run: Optional[str] = RunArg,
    out: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                       help="Where to write it (default: ./model-RUN.keras)."),
) -> None:
    """Copy the model a run's chief saved (model.keras on its host) here, checked by size and SHA-256."""
    from launcher.commands.fetch import fetch as fetch_model

    fetch_model(_which(run), out, _say)


@command()
def rm(runs: list[str] = typer.Argument(..., help="Run ids ('ls' lists them).", show_default=False,
                                        metavar="RUN")) -> None:
    """Remove the records of ended runs (a live run is refused); a local run's checkpoint and model are kept."""
    from launcher.commands import listing

    listing.remove(runs)


@command()
def prune(
    older_than: Optional[str] = typer.Option(None, "--older-than", metavar="AGE",
                                             help="Also every ended run older than AGE (e.g. 90m, 12h, 7d, 2w)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list the runs it would remove."),
) -> None:
    """Remove the records of runs the preflight refused (they started nothing), and with --older-than of old ended
    runs; checkpoints and models are kept."""
    from launcher.commands import listing

    listing.prune(older_than, dry_run=dry_run)


@command()
def render(
    spec: Path = SpecArg,
    to: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE",
                                     help="Write the manifest here (default: stdout)."),
) -> None:
    """Write the Kubernetes JobSet of a [kubernetes] SPEC (YAML), checked against JobSet's API."""
    from launcher.errors import SpecError
    from launcher.commands.paths import output_file
    from launcher.spec.cluster import KubernetesSpec
    from launcher.spec.file import load_spec

    output = output_file(to, "-o", "jobset.yaml")
    cluster = load_spec(spec)
    if not isinstance(cluster, KubernetesSpec):
        raise SpecError(f"{spec} has no [kubernetes] table: 'render' writes a JobSet for Kubernetes; "
                        "'mgpu-cluster up' runs [[hosts]] and [slurm] specs")
    from launcher.engines.kubernetes import render as render_manifest

    text = render_manifest(cluster)  # named by the spec: the same spec, the same file
    if output is None:
        typer.echo(text, nl=False)
        return
    from worker.host.files import write_private

    try:  # owner only: it holds the spec's env as given, secrets included
        write_private(output, text)
    except OSError as exc:
        raise SpecError(f"cannot write {output}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {output}; apply it with: kubectl apply -f {output}")

@command("tf-config")
def tf_config(
    spec: Path = SpecArg,
    task: Optional[int] = typer.Option(None, "--task", help="Task index.", metavar="N"),
    all_: bool = typer.Option(False, "--all", help="Every task's TF_CONFIG."),
) -> None:
    """Print the TF_CONFIG of one task (or of all) as JSON; for backend = "jax", its KERAS_* variables."""
    from launcher.errors import SpecError
    from launcher.plan import plan_tasks
    from launcher.spec.cluster import HostsSpec
    from launcher.spec.file import load_spec
    from worker.host.env import KERAS_VARIABLES, TF_CONFIG, Backend

    cluster = load_spec(spec)
    if all_ == (task is not None):
        raise SpecError("Give exactly one of --task N or --all.")
    jax = cluster.training.backend is Backend.JAX
    if not isinstance(cluster, HostsSpec):
        raise SpecError(f"{spec}: with [slurm] or [kubernetes], each task builds its "
                        f"{'KERAS_DISTRIBUTION_* variables' if jax else TF_CONFIG} when it starts, from "
                        "the nodes Slurm gave the job or the JobSet's host names; 'mgpu-cluster up --dry-run' shows how")
    if task is not None and not 0 <= task < cluster.num_workers:  # not --all
        raise SpecError(f"--task {task}: {spec} has tasks 0..{cluster.num_workers - 1}.")
    plans = plan_tasks(cluster, "tf-config")  # the one builder's
    configs: list[dict[str, object]]
    if jax:  # the counterpart of TF_CONFIG: what keras.distribution.initialize() reads
        configs = [{k: p.env[k] for k in KERAS_VARIABLES if k in p.env} for p in plans]
    else:
        configs = [json.loads(p.env[TF_CONFIG]) for p in plans]
    typer.echo(json.dumps(configs if task is None else configs[task], indent=2))

@command()
def schema() -> None:
    """Print the JSON Schema of cluster.toml (for editors)."""
    from launcher.spec.cluster import spec_schema

    typer.echo(json.dumps(spec_schema(), indent=2))


def main() -> None:
    from launcher.run import interrupts

    interrupts.install()  # Ctrl-C, TERM, HUP: exit 130 from any command, at any moment
    try:
        returned = app(standalone_mode=False, prog_name="mgpu-cluster")  # typer returns 130 for a KeyboardInterrupt it caught
        code = returned if isinstance(returned, int) else 0
        if code == 130:
            _error(interrupts.reason())
    except MgpuError as exc:
        code = exc.exit_code
        _error(str(exc))
    except KeyboardInterrupt:
        code = 130
        _error(interrupts.reason())
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        code = 2  # a read or write that no command told in its own words: still one paragraph, no traceback
        where = exc.filename if isinstance(exc.filename, (str, os.PathLike)) else "a file it needs"
        _error(f"cannot read or write {where}: {exc.strerror or exc}. Check that path: its permissions, the free "
               "space there, or a read-only MGPU_HOME.")
    except Exception as exc:  # click's (or typer's own copy of click's) usage errors and aborts
        names = {cls.__name__ for cls in type(exc).__mro__}
        if "ClickException" in names:
            code = 2
            said = _unknown_option(exc)
            if said:
                _error(said)
            else:
                try:
                    if isinstance(exc, _Shown):
                        exc.show()
                except OSError:
                    pass
        elif "Abort" in names:
            code = 130
            _error(interrupts.reason())
        elif "Exit" in names:
            code = getattr(exc, "exit_code", 0)
        else:
            raise
    if interrupts.pending():  # a signal that came while the teardown was shielded
        code = 130
    if code == 0 and _said:
        _say(_said[0])
    _exit(code)


@runtime_checkable
class _Shown(Protocol):
    """A click exception (click's, or typer's own copy): it prints itself."""

    def show(self) -> None: ...


def _unknown_option(exc: Exception) -> str | None:
    """An option that `up` or `check` does not have: most often the training's own, which go after -- (one
    paragraph that shows the command line that works)."""
    import difflib

    ctx, name = getattr(exc, "ctx", None), getattr(exc, "option_name", None)
    command_name = ctx.info_name if ctx is not None else None
    if type(exc).__name__ != "NoSuchOption" or ctx is None or command_name not in ("up", "check") or not name:
        return None
    mine = [o for p in ctx.command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
            if o.startswith("-") and not getattr(p, "hidden", False)]
    close = difflib.get_close_matches(name, mine, n=1, cutoff=0.8)
    words = sys.argv[1:]
    at = words.index(command_name) + 1 if command_name in words else 1
    head, rest = words[at:], []
    for i, word in enumerate(head):
        if word == name or word.startswith(name + "="):
            head, rest = head[:i], head[i:]
            break
    flags = {o for p in ctx.command.params if getattr(p, "is_flag", False) for o in getattr(p, "opts", ())}
    keep = [w for w in rest if w in flags and w != "--"]
    training = [w for w in rest if w not in flags and w != "--"]
    spec = next((w for w in head if not w.startswith("-")), None)
    if spec is None:  # the unknown option came before the spec: the spec still goes before --
        spec = next((w for w in training if w.endswith(".toml")), "SPEC")
        training = [w for w in training if w != spec]
        head = [spec, *head]
    line = " ".join(["mgpu-cluster up", *([spec] if command_name == "check" else head + keep), "--", *training])
    mean = f" (did you mean {close[0]}?)" if close else ""
    if command_name == "check":
        return (f"check has no option {name}{mean}. No such option goes to the training either: check starts no "
                f"training, so it takes no training arguments; they go to up, after --: {line}")
    return (f"up has no option {name}{mean}. No such option goes to the training either: its own arguments go "
            f"after --, where up passes them on untouched: {line}")


def _error(message: str) -> None:
    from launcher.run.output import Output

    Output(threaded=False).error(message)


def _say(line: str) -> None:
    try:
        typer.echo(line, err=True)
    except OSError:
        pass


def _exit(code: int) -> None:
    """Exit with `code`, also when stdout was closed under us (`up | head`)."""
    try:
        sys.stdout.flush()
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    # What sys.exit would do (the interpreter's own two shutdown steps: wait for non-daemon threads,
    # executors' exit hooks included, then atexit), less the teardown of every module (~40 ms).
    threading._shutdown()  # type: ignore[attr-defined]  # private, so not in typeshed; no public equivalent
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
