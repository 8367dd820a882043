"""The `kubevbmc` command: agent, controller, sim and demo."""

from __future__ import annotations

import argparse
import importlib

# name, help, the module with add_arguments(parser) and run(args)
SUBCOMMANDS = (
    ("sim", "run kubesim, a simulated Kubernetes cluster with KubeVirt", "kubesim.cli"),
    ("demo", "a simulated cluster with a few VMs and their BMCs", "vbmc.demo"),
    ("agent", "serve IPMI and Redfish for one VM (or, with --pool, for many)", "vbmc.agent.command"),
    ("controller", "reconcile VirtualMachineBMCs into agents", "controller.cli"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubevbmc",
                                     description="A virtual BMC for KubeVirt virtual machines.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_, module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_)
        module.add_arguments(command)
        command.set_defaults(run=module.run, parser=command)
    args = parser.parse_args(argv)
    check_choices(args.parser, args)
    return int(args.run(args) or 0)


def check_choices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse checks the choices of values given on the command line, not of defaults; flags here default to
    environment variables (as a Deployment sets them), so a bad one gets the same clear error."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(repr(c) for c in action.choices)
            parser.error(f"argument {'/'.join(action.option_strings)}: invalid choice: {value!r} "
                         f"(choose from {choices}; set through the environment?)")
