"""The TaskService routes: the tasks of virtual media inserts (taskstore.py keeps them)."""

from __future__ import annotations

from flask import Blueprint, Response, request

from . import resources
from .errors import not_found
from .resources import TASKS
from .service import Service
from .taskstore import follow


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("tasks", __name__)
    route = svc.route

    @route(bp, resources.TASK_SERVICE)
    def task_service() -> Response:
        return svc.static("task_service", "TaskService", resources.task_service)

    @route(bp, TASKS)
    def tasks() -> Response:
        return svc.send_doc("TaskCollection", resources.collection(
            "TaskCollection", TASKS, "Tasks", [f"{TASKS}/{t.id}" for t in svc.tasks.list()]))

    @route(bp, f"{TASKS}/<task_id>")
    def task(task_id: str) -> Response:
        found = svc.tasks.get(task_id)
        if found is None:
            raise not_found(request.path)
        return svc.send_doc("Task", resources.task(follow(found, svc.machine)))

    return bp
