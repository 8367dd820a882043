"""`kubevbmc controller`: reconcile VirtualMachineBMCs into agents."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys

from . import settings as settings_

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (`--log-format json`), so a log collector needs no parsing rules."""

    def format(self, record: logging.LogRecord) -> str:
        at = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {"time": at.isoformat(timespec="milliseconds"), "level": record.levelname.lower(),
                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_handler(log_format: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        handlers=[log_handler(args.log_format)])
    from .runtime import run as run_manager

    return run_manager(settings_.settings_from(args), args.kubeconfig)
