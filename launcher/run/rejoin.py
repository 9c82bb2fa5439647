"""Hosts that come back (elastic runs, `min_hosts`): each lost host is asked again, with a back-off (seconds at
first, then minutes), and once it answers it is checked as `up` checks a host; one that passes is ready to rejoin
the group at its next regroup. A host lost again soon after it came back is kept out for a cooldown first, twice as
long each time it does so again (at most the spec's ceiling): a host that flaps does not stall the run.

`Absences` is the policy (pure: every moment is given); `Rejoin` asks the hosts on a thread of its own."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

PROBE_FIRST_S = 5.0  # the first look after a host is lost; each look that finds it still gone doubles the wait
PROBE_MAX_S = 300.0
FLAP_WINDOW_S = 600.0  # a host lost again within this long after it came back flaps: it is kept out first
TICK_S = 1.0


@dataclass
class Absent:
    """One lost host's standing: when it is asked next, until when it is kept out, whether it passed."""

    index: int
    next_look: float
    every: float = PROBE_FIRST_S
    kept_out_until: float = 0.0
    ready: bool = False
    why: str = ""  # why its last look failed


@dataclass
class Absences:
    """The lost hosts of an elastic run and the hosts that came back (for their cooldowns)."""

    cooldown: float  # the first cooldown of a host that flaps
    cooldown_max: float
    absent: dict[int, Absent] = field(default_factory=dict)
    back_at: dict[int, float] = field(default_factory=dict)  # when each host that came back rejoined
    cooldowns: dict[int, float] = field(default_factory=dict)  # the next cooldown of each host that flapped

    def lost(self, index: int, now: float) -> float:
        """Host `index` is lost: asked again after the back-off; one that came back within FLAP_WINDOW_S is kept
        out for its cooldown first (which doubles each time, up to the ceiling). The cooldown given (0: none)."""
        came = self.back_at.pop(index, None)
        keep = 0.0
        if came is not None and now - came <= FLAP_WINDOW_S:
            keep = self.cooldowns.get(index, self.cooldown)
            self.cooldowns[index] = min(keep * 2, self.cooldown_max)
        elif came is not None:  # it stayed a while: forgiven
            self.cooldowns.pop(index, None)
        self.absent[index] = Absent(index, next_look=now + max(keep, PROBE_FIRST_S), kept_out_until=now + keep)
        return keep

    def due(self, now: float) -> list[int]:
        """The lost hosts to ask now."""
        return [a.index for a in self.absent.values() if not a.ready and now >= max(a.next_look, a.kept_out_until)]

    def looked(self, index: int, why: str | None, now: float) -> bool:
        """What asking host `index` found: None, it answers and passed the checks (ready); else why not (asked
        again after twice the wait, at most PROBE_MAX_S). True when it became ready now."""
        a = self.absent.get(index)
        if a is None or a.ready:
            return False
        if why is None:
            a.ready = True
            return True
        a.why, a.next_look, a.every = why, now + a.every, min(a.every * 2, PROBE_MAX_S)
        return False

    def ready(self) -> list[int]:
        return sorted(a.index for a in self.absent.values() if a.ready)

    def back(self, indices: list[int], now: float) -> None:
        """These hosts rejoined the group."""
        for i in indices:
            self.absent.pop(i, None)
            self.back_at[i] = now


class Rejoin:
    """Asks the lost hosts on a thread of its own (`look(index)`: None where the host answers and passes the
    preflight, else why not); `ready()` names those that may rejoin."""

    def __init__(self, absences: Absences, look: Callable[[int], str | None],
                 logged: Callable[[str], None] = lambda _line: None):
        self.absences, self.look, self.logged = absences, look, logged
        self.lock = threading.Lock()  # guards absences: the agent's thread and ours
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def lost(self, index: int) -> float:
        with self.lock:
            keep = self.absences.lost(index, time.monotonic())
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="rejoin")
            self.thread.start()
        return keep

    def back(self, indices: list[int]) -> None:
        with self.lock:
            self.absences.back(indices, time.monotonic())

    def ready(self) -> list[int]:
        with self.lock:
            return self.absences.ready()

    def absent(self) -> list[int]:
        with self.lock:
            return sorted(self.absences.absent)

    def _run(self) -> None:
        while not self.closed.wait(TICK_S):
            with self.lock:
                due = self.absences.due(time.monotonic())
            for index in due:
                if self.closed.is_set():
                    return
                try:
                    why = self.look(index)
                except Exception as exc:  # a look that fails is a host not back yet: never the run's end
                    why = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    now = time.monotonic()
                    self.absences.looked(index, why, now)
                    wait = self.absences.absent[index].next_look - now if index in self.absences.absent else 0.0
                self.logged(f"lost task {index} asked again: " + (f"not back ({why}); asked again in {wait:.0f} s"
                                                                  if why is not None else "it passes"))

    def close(self) -> None:
        self.closed.set()
