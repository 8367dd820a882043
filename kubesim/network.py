"""Placeholder: filled in by its own change."""

from __future__ import annotations

from typing import Any


def install(cluster: Any) -> None:
    """Register this part of the simulated cluster with `cluster`."""
