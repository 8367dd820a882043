"""`kubevbmc controller`: reconcile VirtualMachineBMCs into agents."""

from __future__ import annotations

import argparse
import logging
import sys

from . import settings as settings_


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .runtime import run as run_manager

    return run_manager(settings_.settings_from(args), args.kubeconfig)
