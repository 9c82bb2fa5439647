"""Our lines on a task's stdout, each in one write: with PYTHONUNBUFFERED set, print() writes the text and its
newline apart, and a C++ library's own line (JAX's gloo, TensorFlow's log) landed between the two, so that the
console saw "task 1 of 2 ... (16/replica)[Gloo] Rank 1 is connected ..." as one line of ours."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
