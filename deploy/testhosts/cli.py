"""The command line: up, down, env, crash, cut, restore, revive (python deploy/testhosts.py ...)."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from .cluster_toml import DEFAULT_PORT
from .hosts import MAX_HOSTS, TestHosts
from .system import TestHostsError, _write


def _cmd_up(args) -> int:
    th = TestHosts(args.n, args.state, args.prefix)
    th.up()
    toml_text = th.cluster_toml(args.port)
    _write(th.state_dir / "cluster.toml", toml_text, 0o644)
    sys.stdout.write(toml_text)
    state = shlex.quote(str(th.state_dir))
    print(f"testhosts: {args.n} hosts up in {th.timings['up']:.2f}s "
          f"({', '.join(th.addresses)}); state in {th.state_dir}\n"
          f"  use:  eval \"$(python {sys.argv[0]} env --state {state})\"\n"
          f"  ssh:  ssh -F {th.ssh_config} {th.addresses[0]}\n"
          f"  stop: python {sys.argv[0]} down --state {state}", file=sys.stderr)
    return 0


def _cmd_down(args) -> int:
    if args.state:
        th = TestHosts.load(args.state)
    else:
        th = TestHosts(MAX_HOSTS, Path(tempfile.gettempdir()) / f"testhosts-{args.prefix}-nostate", args.prefix)
    th.down()
    print(f"testhosts: {th.prefix} removed", file=sys.stderr)
    return 0


def _cmd_env(args) -> int:
    th = TestHosts.load(args.state)
    print(f"export HOME={shlex.quote(str(th.home))}")
    print(f"# ssh -F {shlex.quote(str(th.ssh_config))} {th.addresses[0] if th.hosts else '<address>'}")
    return 0


def _cmd_fault(args) -> int:
    th = TestHosts.load(args.state)
    result = getattr(th, args.cmd)(args.i)
    if args.cmd == "crash":
        print(f"killed {len(result)} processes: {' '.join(map(str, result))}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="testhosts.py", description="Fake cluster hosts for tests: network "
                                "namespaces on a private bridge, each with its own sshd.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create N hosts, print a cluster.toml, write STATE/hosts.json")
    up.add_argument("n", type=int)
    up.add_argument("--state", required=True, help="folder for keys, configs, logs, hosts.json")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="worker port in cluster.toml")
    up.add_argument("--prefix", help="name stem (default: random, e.g. mgt1a2b3c)")
    down = sub.add_parser("down", help="remove the hosts of --state (or of --prefix)")
    g = down.add_mutually_exclusive_group(required=True)
    g.add_argument("--state")
    g.add_argument("--prefix")
    env = sub.add_parser("env", help="print `export HOME=...` for fabric/paramiko")
    env.add_argument("--state", required=True)
    for name, text in (("crash", "kill every process of host I"), ("cut", "take host I off the network"),
                       ("restore", "reconnect host I"), ("revive", "restart host I's sshd")):
        f = sub.add_parser(name, help=text)
        f.add_argument("i", type=int)
        f.add_argument("--state", required=True)
    args = p.parse_args(argv)
    handler = {"up": _cmd_up, "down": _cmd_down, "env": _cmd_env}.get(args.cmd, _cmd_fault)
    try:
        return handler(args)
    except (TestHostsError, ValueError) as e:
        print(f"testhosts: {e}", file=sys.stderr)
        return 2
