"""The Redfish frontend: a Flask app over one Machine (`create_app`) and its gunicorn server (`server`).

`create_app` is imported lazily so that the gunicorn master, which imports `server`, stays free of Flask and
pydantic: they are loaded only in the worker, after the fork."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
