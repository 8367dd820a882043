"""The TaskService: virtual media inserts as tasks that follow the import (DSP0266 "Asynchronous operations").

An InsertMedia answers 202 with a Task. The Task follows the medium in its slot: Running with PercentComplete from
the import's progress, then Completed once the medium is in, or Exception with the reason (the image server's
answer, CDI's failure, an eject). Tasks are kept in memory, the last MAX_TASKS of them: an agent restart forgets them
(the medium and its DataVolume are in the cluster; its state is on the VirtualMedia resource)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..access.audit import redact_url
from ..machine import Machine, MachineError, MediaState

MAX_TASKS = 32


@dataclass
class Task:
    id: str
    slot: str
    image: str  # as inserted (the medium's URL is compared with it)
    started: float = field(default_factory=time.time)
    state: str = "Running"  # Running, Completed, Exception
    percent: int | None = 0
    message: str = ""
    ended: float | None = None

    @property
    def shown_image(self) -> str:
        return redact_url(self.image)

    def end(self, state: str, message: str, percent: int | None = None) -> None:
        self.state, self.message, self.ended = state, message, time.time()
        if percent is not None:
            self.percent = percent


class TaskStore:
    def __init__(self) -> None:
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, slot: str, image: str) -> Task:
        with self._lock:
            task = Task(str(next(self._ids)), slot, image)
            self._tasks[task.id] = task
            while len(self._tasks) > MAX_TASKS:
                self._tasks.popitem(last=False)
            return task

    def get(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def list(self) -> list[Task]:
        with self._lock:
            return list(self._tasks.values())


def follow(task: Task, machine: Machine) -> Task:
    """Bring a running task up to date with its slot (read from the cache; nothing is written)."""
    if task.state != "Running":
        return task
    try:
        media = machine.virtual_media(task.slot)
    except MachineError:
        return task  # the backend cannot answer now: still running, as far as anyone knows
    if media.image != task.image:
        task.end("Exception", "The medium was ejected or replaced before its import finished.")
    elif media.state == MediaState.INSERTED:
        task.end("Completed", "The image is inserted.", 100)
    elif media.state == MediaState.FAILED:
        task.end("Exception", f"The image could not be imported: {media.message}")
    elif media.progress is not None:
        task.percent = media.progress
    return task
