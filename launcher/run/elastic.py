"""An elastic run's group (`min_hosts`, [[hosts]]): hosts that no longer answer are left out, and taken back once
they answer and pass the preflight again, at a regroup the group saves for (the notice of a preemption). Shrinking
and growing are counted apart from max_restarts; growing costs at most `regroup_share` of the run's time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from launcher.engines import engine_for
from launcher.engines.base import Launching, Result
from launcher.run.record import RunRecord
from launcher.run.rejoin import Absences, Rejoin
from launcher.spec.cluster import ClusterSpec, Launch

Say = Callable[[str], None]


class Elastic:
    def __init__(self, spec: ClusterSpec, run: RunRecord, say: Say, label: Callable[[int], str],
                 logged: Say = lambda _line: None):
        self.spec, self.run, self.say, self.label = spec, run, say, label
        launch = spec.launch
        self.rejoin = Rejoin(Absences(launch.rejoin_cooldown, launch.rejoin_cooldown_max), self.look, logged)
        self.regrouping: list[int] = []  # the hosts the group takes back once it has saved (its notice was sent)
        self.growing = False  # the current attempt began with a grow: what growing cost is told at its first step
        self.over_budget_told = False

    @property
    def launch(self) -> Launch:
        return self.spec.launch

    # ---- shrinking
    def left(self, indices: list[int], answers: list[Result[float]]) -> list[int] | None:
        """After an attempt failed: the tasks whose hosts still answer, the others left out (recorded, said, and
        asked again from now on); None where none was lost, or too few answer to go on (min_hosts)."""
        min_hosts = self.launch.min_hosts
        by_index = dict(zip(indices, answers))
        gone = [i for i in indices if not by_index[i].ok]
        left = [i for i in indices if by_index[i].ok]
        if min_hosts is None or not gone or len(left) < min_hosts:
            return None
        self.run.shrank(gone)
        for i in gone:
            keep = self.rejoin.lost(i)
            if keep:
                then = (f"it was lost again soon after it came back, so it is kept out for {keep:g} s (twice as long "
                        f"each time it does so again, at most {self.launch.rejoin_cooldown_max:g} s) before it is "
                        "asked again")
            else:
                then = "it is asked again from time to time, and taken back once it answers and passes the preflight"
            self.say(f"{self.label(i)} is left out: {str(by_index[i].error).rstrip('.')}; {then}")
        return left

    # ---- growing
    def look(self, index: int) -> str | None:
        """Whether lost host `index` answers and passes the preflight that `up` runs: None, or why not."""
        engine = engine_for(self.spec, self.run.run_id, only=[index], landed=self.run)
        try:
            if not isinstance(engine, Launching):
                return "its engine starts no tasks"
            answer = engine.reachable([index])[0]
            if not answer.ok:
                return str(answer.error)
            checks = engine.preflight(Path(self.run.spec_path).parent, lambda _text: None)
            problems = [p for c in checks for p in c.problems]
            return "; ".join(problems) if problems else None
        finally:
            engine.close()

    def to_take_back(self) -> list[int]:
        """The lost hosts the group may take back now: those that answer and passed the preflight again, where
        growing has cost no more than regroup_share of the run's time so far (else said once, and later)."""
        if self.regrouping:
            return []
        ready = self.rejoin.ready()
        if not ready:
            return []
        elapsed = max(time.time() - self.run.created_at, 1e-9)
        spent = self.run.grow_spent_s()
        if spent > self.launch.regroup_share * elapsed:
            if not self.over_budget_told:
                self.over_budget_told = True
                self.say(f"{self.names(ready)} answer again, but growing has cost {spent:.1f} s of the run's "
                         f"{elapsed:.0f} s, more than regroup_share = {self.launch.regroup_share:g} of it: taken back "
                         "once the run has trained longer without regrouping")
            return []
        self.over_budget_told = False
        return ready

    def noticed(self, back: list[int], tasks: int) -> None:
        """The group was told to save and end for `back` to rejoin it."""
        self.regrouping = back
        self.say(f"{self.names(back)} answer{'s' if len(back) == 1 else ''} again and passed the preflight: the "
                 f"group saves at its next step and goes on with {tasks + len(back)} task(s)")

    def grown(self) -> list[int]:
        """The group saved: the hosts it takes back (recorded)."""
        back, self.regrouping, self.growing = self.regrouping, [], True
        self.run.grew(back)
        self.rejoin.back(back)
        return back

    def attempt_begins(self) -> None:
        """A notice whose attempt ended otherwise (a failure) takes nobody back: the hosts stay ready."""
        self.regrouping = []

    def first_step(self) -> None:
        """The group trains again: what growing has cost (the record's), once after each grow."""
        if not self.growing:
            return
        self.growing = False
        elapsed = time.time() - self.run.created_at
        self.say(f"growing has cost {self.run.grow_spent_s():.1f} s of the run's {elapsed:.0f} s so far (each regroup "
                 f"from its notice to the first step; at most regroup_share = {self.launch.regroup_share:g} of it)")

    def names(self, indices: list[int]) -> str:
        return ", ".join(self.label(i) for i in indices)

    def close(self) -> None:
        self.rejoin.close()
