"""The Redfish frontend: a Flask app over one Machine (`create_app`) and the agent's server for it (`server`).

`create_app` is imported lazily: importing `server` (the agent does, to bind its ports first) loads neither Flask
nor pydantic.

Inside: the app and its routes (`app`, `systems`, `managers`, `media`, `tasks`, `events`, `logs`, `accounts`), the
documents they render (`resources`), the EventService with its subscriptions and deliveries (`eventservice`), and
the HTTP server (`server`).

May import `vbmc.machine` (not its backends) and `vbmc.access`; never `vbmc.ipmi` or the agent."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
