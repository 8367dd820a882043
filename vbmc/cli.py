"""The `kubevbmc` command: agent, controller, sim and demo."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubevbmc",
                                     description="A virtual BMC for KubeVirt virtual machines.")
    sub = parser.add_subparsers(dest="command", required=True)

    from kubesim import cli as sim_cli

    sim = sub.add_parser("sim", help="run kubesim, a simulated Kubernetes cluster with KubeVirt")
    sim_cli.add_arguments(sim)
    sim.set_defaults(run=sim_cli.run)

    from . import demo

    demo_parser = sub.add_parser("demo", help="a simulated cluster with a few VMs and their BMCs")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    from . import agent

    agent_parser = sub.add_parser("agent", help="serve IPMI and Redfish for one VM")
    agent.add_arguments(agent_parser)
    agent_parser.set_defaults(run=agent.run)

    from controller import cli as controller_cli

    controller = sub.add_parser("controller", help="reconcile VirtualMachineBMCs into agents")
    controller_cli.add_arguments(controller)
    controller.set_defaults(run=controller_cli.run)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"kubevbmc {name}: not implemented yet", file=sys.stderr)
        return 2

    return run
