"""The supervised engine: our supervisor runs each task on its host (local process or SSH)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from launcher.engines import Engine
from launcher.plan import TaskPlan
from launcher.spec import ClusterSpec
from launcher.transport import Handle, Result, Sink, parallel, transports_for


class SupervisedEngine(Engine):
    kind = "supervised"
    beats = True  # our supervisors' Stats

    def __init__(self, spec: ClusterSpec, plans: list[TaskPlan]):
        super().__init__(spec, plans)
        self.transports = dict(zip((p.index for p in plans), transports_for(spec, plans)))
        self.handles: dict[int, Handle] = {}

    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list:
        from launcher.preflight import preflight

        return preflight(self.spec, self.plans, [self.transports[p.index] for p in self.plans], base=base, say=say,
                         hold=for_start)

    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        def one(plan: TaskPlan) -> None:
            # kept at once: a stop (Ctrl-C) that comes while other tasks still start must find it
            self.handles[plan.index] = self.transports[plan.index].start(plan, attempt, sink)

        results = parallel(one, self.plans)
        return {p.index: str(r.error) for p, r in zip(self.plans, results) if not r.ok}

    def stop(self, indices: list[int]) -> None:
        for i in indices:
            handle = self.handles.pop(i, None)
            if handle is not None:
                handle.stop()

    def _grouped(self, indices: list[int], fn) -> list[Result[dict]]:
        """fn(transport, plans) once per host, in parallel; per task, in the order of `indices`."""
        groups: dict = {}
        for i in indices:
            groups.setdefault(self.transports[i], []).append(self.plan[i])
        items = list(groups.items())
        found: dict[int, Result[dict]] = {}
        for (transport, plans), res in zip(items, parallel(lambda g: fn(*g), items)):
            for n, plan in enumerate(plans):
                found[plan.index] = Result(value=res.value[n]) if res.ok else Result(error=res.error)
        return [found[i] for i in indices]

    def stop_from_folders(self, indices: list[int]) -> list[Result[dict]]:
        return self._grouped(indices, lambda t, plans: t.stop_tasks(plans))

    def probe(self, indices: list[int]) -> list[Result[dict]]:
        return self._grouped(indices, lambda t, plans: t.probe(plans))

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[str, int]:
        plan, transport = self.plan[index], self.transports[index]
        path = f"{plan.run_dir}/worker.log"
        if tail is not None:
            code, size, _err = transport.call(plan, ["stat", "-c", "%s", path], 30)
            if code != 0:
                return "", offset
            code, text, _err = transport.call(plan, ["tail", "-n", str(tail), path], 30)
            return (text if code == 0 else ""), int(size.strip() or 0)
        code, text, _err = transport.call(plan, ["tail", "-c", f"+{offset + 1}", path], 30)
        if code != 0:
            return "", offset
        return text, offset + len(text.encode())

    def reachable(self, indices: list[int]) -> list[Result[float]]:
        return parallel(lambda i: self.transports[i].connect(), indices)

    def close(self) -> None:
        for t in set(self.transports.values()):
            t.close()
