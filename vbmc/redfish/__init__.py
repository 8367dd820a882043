"""The Redfish frontend: a Flask app over one Machine (`create_app`) and the agent's server for it (`server`).

`create_app` is imported lazily: importing `server` (the agent does, to bind its ports first) loads neither Flask
nor pydantic."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
