"""The worker's error for a problem the user can fix (`python -m worker` prints it and exits 2)."""


class WorkerError(Exception):
    """A problem the user can fix; the message says what to do (no traceback needed)."""


class SettingError(WorkerError, ValueError):
    """An environment variable the worker cannot use (TF_CONFIG, MGPU_TASK_INDEX, ...); the message names it."""
