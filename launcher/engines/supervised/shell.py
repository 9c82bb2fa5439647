"""Command lines for a remote POSIX shell: every value quoted with shlex, nothing interpreted."""

from __future__ import annotations

import shlex


def _cd(cwd: str) -> str:
    """`cd` to cwd, quoted; a leading ~ or ~/ stays expandable (quoting would make it literal)."""
    if cwd == "~":
        return "cd ~"
    if cwd.startswith("~/"):
        return "cd ~/" + shlex.quote(cwd[2:])
    return "cd " + shlex.quote(cwd)


def shell_command(argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    """A POSIX shell line that runs argv in cwd with env; every value quoted, nothing interpreted."""
    line = shlex.join(["env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]) if env else shlex.join(argv)
    return f"{_cd(cwd)} && exec {line}" if cwd else f"exec {line}"
