"""Error types a user can cause; the CLI turns each into one paragraph and an exit code."""


class MgpuError(Exception):
    """Base: `str(err)` is the whole message the user sees; `exit_code` is what the CLI returns."""

    exit_code = 1


class SpecError(MgpuError):
    """The spec file is missing, unreadable or invalid."""

    exit_code = 2


class PreflightError(MgpuError):
    """A host or port is not ready; nothing was started."""

    exit_code = 2


class RunNotFound(MgpuError):
    exit_code = 2


class RunFailed(MgpuError):
    """A task failed and the run was stopped (`exit_code`: 1, or the code a detached launcher ended with)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(MgpuError):
    exit_code = 130


class RunCorrupt(MgpuError):
    """A run's record cannot be read (corrupt, or from another version)."""

    exit_code = 2


class HomeError(MgpuError):
    """MGPU_HOME cannot be written."""

    exit_code = 2


class ReportError(MgpuError):
    """A run's report cannot be drawn (refused run, no matplotlib, a path that cannot be written)."""

    exit_code = 2


class BadArgument(MgpuError):
    """A command-line argument that cannot be used as given (an output path that is a folder, ...)."""

    exit_code = 2
