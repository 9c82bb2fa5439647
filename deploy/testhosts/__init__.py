"""Fake cluster hosts for tests: network namespaces on a private bridge, each with its own sshd.

Standard library only (plus `ip`, `ssh-keygen`, `sshd`); needs root. See deploy/README.md.
"""

from .cluster_toml import DEFAULT_COMMAND, DEFAULT_PORT, render_cluster_toml
from .cli import main
from .hosts import FIRST_HOST, MAX_HOSTS, SSHD, STATE_FILE, Host, TestHosts
from .system import (_LOCK_FILE, TestHostsError, _claim_bridge, _kill, _kill_netns, _link_names, _netns_list,  # noqa: F401
                     _netns_pids, _run, _sshd_version, _tail, _used_third_octets, _write, netns_usage)

__all__ = ["Host", "TestHosts", "TestHostsError", "render_cluster_toml", "main", "netns_usage", "DEFAULT_COMMAND",
           "DEFAULT_PORT", "FIRST_HOST", "MAX_HOSTS", "SSHD", "STATE_FILE"]
