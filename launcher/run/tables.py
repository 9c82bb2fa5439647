"""The tables a person reads: preflight checks, the end-of-run summary, `status`.

On a terminal they fit its width (80 columns included) by dropping the least useful columns, and `status`
names the ones it dropped; states and task names are never cut. `status` chooses its columns from the width
alone, so a `--watch` frame never swaps them as values grow. Not on a terminal, it prints plain columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from launcher.engines.base import TaskCheck
from launcher.run.record import RunRecord
from launcher.run.view import Snapshot

SHORT = 40  # characters of a problem in the preflight table
HOSTS_NAMED = 6  # hosts named in a problem's paragraph, then a count
SPANS = 12  # runs of task indices named there, then a count


def checks_table(checks: list[TaskCheck]) -> Table:
    """One row per task (or the whole job): ok, or the first words of its problem and the numbers of its
    paragraphs in `refused` (each told there once)."""
    refs: dict[int, list[str]] = {}
    for n, told in enumerate(told_once(checks), 1):
        for c in told.checks:
            refs.setdefault(id(c), []).append(str(n))
    table = Table(title="preflight")
    for col in ("task", "host", "port"):
        table.add_column(col, no_wrap=True)
    table.add_column("python", overflow="fold")
    table.add_column("result")
    for c in checks:
        result = Text("ok", style="green") if c.ok else Text(  # one line: the paragraph is below the table
            f"[{','.join(refs[id(c)])}] {short(c.problems[0])}", style="red", no_wrap=True, overflow="ellipsis")
        if c.title:  # a row about the whole job (a scheduler's), not one task
            table.add_row("all", escape(c.title), "", escape(c.plan.python), result)
        else:
            table.add_row(str(c.plan.index), escape(c.plan.host.label), str(c.plan.host.port), escape(c.plan.python),
                          result)
    return table


@dataclass(frozen=True)
class Told:
    """One distinct preflight problem and the checks (tasks, or the whole job) that have it."""

    problem: str
    checks: tuple[TaskCheck, ...]

    @property
    def who(self) -> str:
        """`task 3 (a:2000)`, or `tasks 0-7 (hosts a, b, ...)`."""
        if len(self.checks) == 1 or any(c.title for c in self.checks):
            return ", ".join(c.label for c in self.checks)
        hosts = list(dict.fromkeys(c.plan.host.label for c in self.checks))
        named = ", ".join(hosts[:HOSTS_NAMED]) + (f" and {len(hosts) - HOSTS_NAMED} more"
                                                  if len(hosts) > HOSTS_NAMED else "")
        return f"tasks {spans([c.plan.index for c in self.checks])} ({'hosts' if len(hosts) > 1 else 'host'} {named})"


def told_once(checks: list[TaskCheck]) -> list[Told]:
    """Each distinct problem once, in the order first found, with every check that has it."""
    found: dict[str, list[TaskCheck]] = {}
    for c in checks:
        for problem in dict.fromkeys(c.problems):
            found.setdefault(problem, []).append(c)
    return [Told(problem, tuple(have)) for problem, have in found.items()]


def refused(checks: list[TaskCheck]) -> str:
    """The preflight's problems below its table: one numbered paragraph each, naming its tasks and hosts."""
    return "\n".join(f"  [{n}] {t.who}: {t.problem}" for n, t in enumerate(told_once(checks), 1))


def spans(indices: list[int]) -> str:
    """`0-7, 9` (the first SPANS runs, then a count)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:SPANS])
    return shown + (f" and {sum(b - a + 1 for a, b in runs[SPANS:])} more" if len(runs) > SPANS else "")


def short(problem: str) -> str:
    """A problem's first words, for a table cell."""
    if len(problem) <= SHORT:
        return problem
    cut = problem[:SHORT].rsplit(" ", 1)[0] if " " in problem[:SHORT] else problem[:SHORT]
    return cut.rstrip(" ,;:(") + "…"


def _chosen(columns: list[tuple[str, int, int]], needs: list[int], width: int, used: int) -> list[int]:
    """The columns (name, priority: lower is kept longer, width) kept within `width`, in their order: by
    priority while each one's `needs` fits (the first always)."""
    chosen: list[int] = []
    for i in sorted(range(len(columns)), key=lambda i: columns[i][1]):
        if used + needs[i] <= width or not chosen:
            chosen.append(i)
            used += needs[i]
    return sorted(chosen)


def _table(columns: list[tuple[str, int, int]], chosen: list[int], rows: list[list[str]], title: str,
           fixed_width: bool, no_wrap_below: int) -> Table:
    table = Table(title=title, title_justify="left")
    for i in chosen:
        table.add_column(columns[i][0], width=columns[i][2] if fixed_width else None,
                         no_wrap=columns[i][1] < no_wrap_below, overflow="fold")
    for r in rows:  # as plain text: a host named 'gpu[a100]' is no markup
        table.add_row(*(Text(r[i]) for i in chosen))
    return table


def fit(columns: list[tuple[str, int, int]], rows: list[list[str]], width: int, title: str) -> Table:
    """A table of the columns (name, priority, min width) that fit `width` with what the rows hold."""
    widths = [max([len(c[0])] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    needs = [max(c[2], w) + 3 for c, w in zip(columns, widths)]
    return _table(columns, _chosen(columns, needs, width, 4), rows, title, False, 2)


def _num(v: object, f: str = "{}") -> str:
    return "" if v is None else f.format(v)


def summary(run: RunRecord, width: int = 80) -> Table:
    cols = [("task", 0, 4), ("host", 1, 8), ("state", 0, 9), ("exit", 1, 4), ("epochs", 2, 6),
            ("metrics", 3, 20), ("wall s", 2, 6)] + ([("in group s", 2, 10)] if run.regroups else [])
    rows = []
    for t in run.tasks:
        p = t.progress or {}
        metrics = " ".join(f"{k}={LOSS.format(v)}" for k, v in (p.get("metrics") or {}).items()
                           if isinstance(v, (int, float)))
        wall = f"{t.ended_at - t.started_at:.1f}" if t.started_at and t.ended_at else ""
        epochs = f"{p['epoch']}/{p['epochs']}" if p.get("epoch") and p.get("epochs") else ""
        rows.append([str(t.index), f"{t.host}:{t.port}", str(t.state), _num(t.exit_code), epochs, metrics, wall]
                    + ([f"{run.in_group_s(t.index):.1f}"] if run.regroups else []))
    final = set(run.attempts[-1].tasks) if run.attempts else {t.index for t in run.tasks}  # after a shrink: fewer
    replicas = next((n for t in run.tasks if t.index in final and (n := (t.progress or {}).get("replicas"))), None)
    title = f"run {run.run_id}: {run.state}" + (f", {replicas} replicas in sync" if replicas else "")
    table = fit(cols, rows, width, title)
    if not any(c.header == "metrics" for c in table.columns):  # no room beside the rest: below it
        shown = "\n".join(f"task {r[0]}: {r[5]}" for r in rows if r[5])
        table.caption = Text(shown) if shown else None
        table.caption_justify = "left"
    return table


# (name, priority, width): what a person watching needs first (priority 0-2) stays on 80 columns; the rest goes
# first, named below the table. Each column has its width whatever it holds (a longer value folds in its cell).
STATUS_COLUMNS = [("task", 0, 4), ("host", 3, 21), ("pid", 4, 7), ("state", 0, 9), ("epoch", 1, 9),
                  ("step", 1, 9), ("behind", 2, 6), ("loss", 2, 9), ("heartbeat", 1, 10), ("own samples/s", 1, 13),
                  ("cpu%", 5, 5), ("rss MB", 5, 6)]
LOSS, RATE = "{:.4g}", "{:.0f}"  # one rounding rule for a loss or metric, and for samples/s, wherever they are shown


def fixed(columns: list[tuple[str, int, int]], rows: list[list[str]], width: int, title: str) -> Table:
    """A table of the columns (name, priority, width) that fit `width`, chosen from the widths alone: the same
    columns at a width whatever the rows hold."""
    needs = [c[2] + 3 for c in columns]  # padding and a border
    return _table(columns, _chosen(columns, needs, width, 1), rows, title, True, 1)


def _of(done: int | None, total: int | None) -> str:
    """`3/22`, or `3` when the total is not known; blank before the first epoch (starting)."""
    return "" if done is None else f"{done}/{total}" if total else str(done)


def _age(seconds: float | None) -> str:
    """`6.2 s ago`, `1234 s ago`: within its column's width."""
    return "" if seconds is None else f"{seconds:.1f} s ago" if seconds < 100 else f"{seconds:.0f} s ago"


def status_rows(snap: Snapshot) -> list[list[str]]:
    rows = []
    for t in snap["tasks"]:
        epoch, step = t["position"]  # a running task's: its group's (view.shown_position)
        begun = bool(epoch)  # epoch 0: TensorFlow still starting, no step yet
        rows.append([str(t["index"]), f"{t['host']}:{t['port']}", _num(t["pid"]), t["state"],
                     _of(epoch, t["epochs"]) if begun else "",
                     _of(step, t.get("steps_per_epoch")) if begun else "", _num(t["behind"]),
                     _num(t["loss"], LOSS), _age(t["heartbeat_age"]),
                     _num(t["samples_per_sec"], RATE), _num(t["cpu_percent"]),
                     _num(_mib(t["rss"]))])
    return rows


def _mib(rss: object) -> object:
    return rss // 2**20 if isinstance(rss, (int, float)) and rss else rss


def status_table(snap: Snapshot, width: int) -> Table:
    return fixed(STATUS_COLUMNS, status_rows(snap), width, f"run {snap['run_id']}: {snap['state']}")


def left_out(table: Table, width: int) -> str | None:
    """The line that names the status columns a `width`-column terminal has no room for, if any."""
    shown = {str(c.header) for c in table.columns}
    names = [name for name, _, _ in STATUS_COLUMNS if name not in shown]
    return (f"not shown at {width} columns: {', '.join(names)} (a wider terminal shows them; "
            "'status --json' has every field)") if names else None


def status_plain(snap: Snapshot) -> str:
    """For pipes: every column, nothing cut, one line per task (`status | grep failed` works)."""
    names = [c[0].replace(" ", "_") for c in STATUS_COLUMNS]
    rows = [[v or "-" for v in r] for r in status_rows(snap)]
    widths = [max(len(n), *(len(r[i]) for r in rows)) if rows else len(n) for i, n in enumerate(names)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    head = f"run {snap['run_id']}: {snap['state']}"
    return "\n".join([head, line(names), *(line(r) for r in rows)])


def _split_lines(snap: Snapshot) -> list[str]:
    """The replicas in sync, the step split per task, and the straggler, for the plain and rich views."""
    replicas = next((t["replicas"] for t in snap["tasks"] if t.get("replicas")), None)
    head = [f"replicas in sync: {replicas} over {len(snap['tasks'])} worker(s)"] if replicas else []
    parts = [f"task {t['index']} {t['compute_ms']:.1f} / {t['wait_ms']:.1f}" for t in snap["tasks"]
             if isinstance(t.get("compute_ms"), (int, float)) and isinstance(t.get("wait_ms"), (int, float))]
    lines = head + ([f"ms per step, own work / waiting: {', '.join(parts)}"] if parts else [])
    straggler = snap.get("straggler")
    if straggler:
        lines.append(f"straggler: task {straggler['task']} ({straggler['ratio']:.2f}x the median "
                     "of the others' own work per step)")
    return lines


def _standby_line(snap: Snapshot) -> str | None:
    """Each task's standby (launcher.engines.supervised.standbys) and the memory they hold together."""
    held = [(t["index"], s, _memory(s)) for t in snap["tasks"] if (s := t.get("standby"))]
    if not held:
        return None
    parts = [f"task {i} {'ready' if s.get('ready') else 'importing'}"
             + (f" ({memory // 2**20} MB)" if memory is not None else "") for i, s, memory in held]
    total = sum(memory for _, _, memory in held if memory is not None)
    return f"standbys for attempt {held[0][1].get('attempt')}: {', '.join(parts)}; {total / 2**20:.0f} MB in all"


def _memory(standby: dict[str, object]) -> int | None:
    memory = standby.get("memory")
    return memory if isinstance(memory, int) else None


def _job_line(snap: Snapshot) -> str | None:
    job = snap.get("job")
    if not job or not isinstance(job, dict):
        return None
    reason = f" ({job['reason']})" if job.get("reason") else ""
    return f"slurm job {job['id']}: {job.get('state') or 'unknown to Slurm now'}{reason}"


def group_line(snap: Snapshot) -> str | None:
    """The group at one moment (view.GroupRow): where it is, its loss and its training throughput, the figures
    each task's row gives as its own record said them (`behind`: how many steps that record is older)."""
    g = snap.get("group")
    if not g:
        return None
    where = [f"epoch {_of(g['epoch'], g['epochs'])}" if g["epoch"] else "",
             f"step {_of(g['step'], g['steps_per_epoch'])}" if g["step"] is not None else "",
             f"global step {g['global_step']}" if g["global_step"] is not None else "",
             f"loss {LOSS.format(g['loss'])}" if g["loss"] is not None else "",
             f"{RATE.format(g['samples_per_sec'])} samples/s" if g["samples_per_sec"] is not None else ""]
    return f"group (task {g['task']}'s record, the newest): " + ", ".join(w for w in where if w)


def _regroup_line(snap: Snapshot) -> str | None:
    """An elastic run's group as it changed: hosts left out and taken back, and what each regroup cost."""
    parts = [f"{'left out' if r['kind'] == 'shrank' else 'took back'} task(s) {', '.join(map(str, r['tasks']))} "
             f"before attempt {r['attempt']}" + (f" ({r['took_s']:.1f} s to its first step)" if r["took_s"] else "")
             for r in snap["regroups"]]
    return "group: " + "; ".join(parts) if parts else None


def render(snap: Snapshot, width: int) -> Group:
    """`status` on a terminal: the table, then the lines below it, wrapped at its width (a `--watch` frame
    would cut them there)."""
    table = status_table(snap, width)
    lines = [left_out(table, width), group_line(snap), _job_line(snap), _standby_line(snap), _regroup_line(snap)]
    lines += [f"attempt {a['number']} {a['outcome']}: {a['reason']}" for a in snap["attempts"][:-1] if a["reason"]]
    lines += _split_lines(snap) + [_failure_words(snap)]
    return Group(table, *(Text(line, no_wrap=False, overflow="fold") for line in lines if line))


def plain(snap: Snapshot) -> str:
    """`status` piped: plain columns, then the same lines."""
    lines = [status_plain(snap), *filter(None, [group_line(snap), _job_line(snap), _standby_line(snap),
                                                _regroup_line(snap)]),
             *_split_lines(snap)]
    lines += [f"attempt {a['number']} {a['outcome']}: {a['reason']}" for a in snap["attempts"][:-1] if a["reason"]]
    failure = _failure_words(snap)
    return "\n".join(lines + ([failure] if failure is not None else []))


def _failure_words(snap: Snapshot) -> str | None:
    """The run's failure, as its paragraph (Failure.to_json's message)."""
    message = snap["failure"]["message"] if snap["failure"] else None
    return message if isinstance(message, str) else None
