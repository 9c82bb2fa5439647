"""The host layer: what the launcher and the on-host task core both use (standard library first).

The run's layout on a host (layout), a task's environment and TF_CONFIG (env), files written whole and
owner-only (files), processes found again by pid and start time (procs), how processes start theirs
(spawn), and what a host can tell about itself (system). Nothing here imports TensorFlow or the launcher.
"""
