"""`pods/log`: a container's captured output, served as kube-apiserver serves it from the kubelet.

The kubelet pipes each container process's output through `capture`, which appends it to the container's file
in --log-dir (as it always was, raw) and notes when each line arrived: that is what `timestamps`, `sinceSeconds`
and `sinceTime` need, as the CRI log file's per-line timestamps give them to a real kubelet. Each run of the
container (a restart is a new run, with a new containerID) is a `Run`, so the current and the `previous` one can
be told apart.

The rest is pure: `parse_options` checks the query as ValidatePodLogOptions does (422 Invalid), `pick_container`
as the pod registry's validateContainer (400), `pick_container_id` as the kubelet's validateContainerLogStatus
(400 with its messages), and `select` applies sinceTime, tailLines and limitBytes in the kubelet's order.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import errors

Obj = dict[str, Any]

_READ = 65536


@dataclass(frozen=True)
class LogOptions:
    container: str = ""
    follow: bool = False
    previous: bool = False
    timestamps: bool = False
    since_seconds: int | None = None
    since_time: float | None = None
    tail_lines: int | None = None
    limit_bytes: int | None = None


def _flag(query: dict[str, str], name: str) -> bool:
    """A boolean query parameter as apimachinery converts one: only 0, f and false (any case) are false."""
    value = query.get(name)
    return value is not None and value.lower() not in ("0", "f", "false")


def _int(query: dict[str, str], name: str) -> int | None:
    value = query.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise errors.bad_request(f'strconv.ParseInt: parsing "{value}": invalid syntax') from None


def parse_options(query: dict[str, str], pod_name: str) -> LogOptions:
    """PodLogOptions from a query string; 400 for a value that does not parse, 422 for one out of range."""
    since_time: float | None = None
    if query.get("sinceTime"):
        text = query["sinceTime"]
        try:
            since_time = datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise errors.bad_request(f'parsing time "{text}" as "2006-01-02T15:04:05Z07:00": cannot parse') from None
    opts = LogOptions(container=query.get("container", ""), follow=_flag(query, "follow"),
                      previous=_flag(query, "previous"), timestamps=_flag(query, "timestamps"),
                      since_seconds=_int(query, "sinceSeconds"), since_time=since_time,
                      tail_lines=_int(query, "tailLines"), limit_bytes=_int(query, "limitBytes"))
    causes: list[dict[str, str]] = []
    if opts.tail_lines is not None and opts.tail_lines < 0:
        causes.append({"field": "tailLines", "message": f"Invalid value: {opts.tail_lines}: must be greater than "
                                                        "or equal to 0"})
    if opts.limit_bytes is not None and opts.limit_bytes < 1:
        causes.append({"field": "limitBytes", "message": f"Invalid value: {opts.limit_bytes}: must be greater "
                                                         "than 0"})
    if opts.since_seconds is not None and opts.since_time is not None:
        causes.append({"field": "", "reason": "FieldValueForbidden",
                       "message": "Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified"})
    elif opts.since_seconds is not None and opts.since_seconds < 1:
        causes.append({"field": "sinceSeconds", "message": f"Invalid value: {opts.since_seconds}: must be "
                                                           "greater than 0"})
    if causes:
        raise errors.invalid("PodLogOptions", pod_name, causes)
    return opts


def pick_container(pod: Obj, requested: str) -> str:
    """The container whose log is asked for (the only one when none is named)."""
    spec = pod.get("spec") or {}
    names = [c.get("name", "") for kind in ("initContainers", "containers", "ephemeralContainers")
             for c in spec.get(kind) or [] if isinstance(c, dict)]
    pod_name = pod["metadata"]["name"]
    if requested:
        if requested not in names:
            raise errors.bad_request(f"container {requested} is not valid for pod {pod_name}")
        return requested
    regular = [c.get("name", "") for c in spec.get("containers") or [] if isinstance(c, dict)]
    if len(regular) == 1:
        return regular[0]
    if not regular:
        raise errors.bad_request(f"a container name must be specified for pod {pod_name}")
    raise errors.bad_request(f"a container name must be specified for pod {pod_name}, choose one of: "
                             f"[{' '.join(names)}]")


def pick_container_id(pod: Obj, container: str, previous: bool) -> str:
    """The containerID whose output the kubelet serves, from the pod's status (validateContainerLogStatus)."""
    status = pod.get("status") or {}
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or []),
                *(status.get("ephemeralContainerStatuses") or [])]
    pod_name = pod["metadata"]["name"]
    found = next((s for s in statuses if isinstance(s, dict) and s.get("name") == container), None)
    if found is None:
        raise errors.bad_request(f'container "{container}" in pod "{pod_name}" is not available')
    state, last = found.get("state") or {}, (found.get("lastState") or {}).get("terminated")
    if previous:
        if not last or not last.get("containerID"):
            raise errors.bad_request(f'previous terminated container "{container}" in pod "{pod_name}" not found')
        return str(last["containerID"])
    if "running" in state:
        return str(found.get("containerID") or "")
    if "terminated" in state:
        if state["terminated"].get("containerID"):
            return str(state["terminated"]["containerID"])
        if last and last.get("containerID"):
            return str(last["containerID"])
        raise errors.bad_request(f'container "{container}" in pod "{pod_name}" is terminated')
    if last:
        if not last.get("containerID"):
            raise errors.bad_request(f'container "{container}" in pod "{pod_name}" is terminated')
        return str(last["containerID"])
    reason = (state.get("waiting") or {}).get("reason", "")
    if reason == "ErrImagePull":
        reason = "image can't be pulled"
    elif reason == "ImagePullBackOff":
        reason = "trying and failing to pull image"
    if reason:
        raise errors.bad_request(f'container "{container}" in pod "{pod_name}" is waiting to start: {reason}')
    raise errors.bad_request(f'container "{container}" in pod "{pod_name}" is waiting to start - no logs yet')


def timestamp(at: float) -> str:
    """`at` as Go's RFC3339Nano (trailing zeros of the fraction dropped), as the kubelet prefixes lines."""
    seconds = int(at)
    nanos = round((at - seconds) * 1e6) * 1000  # a float time is good to the microsecond
    if nanos >= 1_000_000_000:
        seconds, nanos = seconds + 1, nanos - 1_000_000_000
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    fraction = f"{nanos:09d}".rstrip("0")
    return f"{text}.{fraction}Z" if fraction else f"{text}Z"


@dataclass(frozen=True)
class Line:
    at: float
    start: int  # byte offsets in the log file
    end: int


def select(lines: list[Line], opts: LogOptions, now: float) -> list[Line]:
    """The lines a request gets before any it follows: since a time, then the last `tailLines`."""
    since = opts.since_time if opts.since_time is not None else (
        now - opts.since_seconds if opts.since_seconds is not None else None)
    out = [line for line in lines if since is None or line.at >= since]
    if opts.tail_lines is not None:
        out = out[len(out) - opts.tail_lines:] if opts.tail_lines else []
    return out


@dataclass
class Run:
    """One run of a container: the lines its process wrote, until its output closed."""

    container_id: str
    offset: int  # where its output starts in the file
    lines: list[Line] = field(default_factory=list)
    ended: bool = False


class ContainerLog:
    """A container's log file and the runs written to it; readers wait on `changed` for more."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.runs: list[Run] = []
        self.changed = threading.Condition(threading.Lock())

    def run(self, container_id: str) -> Run | None:
        with self.changed:
            return next((r for r in reversed(self.runs) if r.container_id == container_id), None)

    def begin(self, container_id: str) -> Run:
        """A new run, whose output starts at the file's end (a recreated pod's container appends to its file)."""
        try:
            offset = os.path.getsize(self.path)
        except OSError:
            offset = 0
        run = Run(container_id, offset)
        with self.changed:
            self.runs.append(run)
        return run

    def capture(self, run: Run, fd: int) -> None:
        """Copy a process's output from `fd` (a pipe, closed here at its end) into the file, noting each line."""
        try:
            with open(self.path, "ab") as out:
                start = pending = out.tell()
                with self.changed:
                    run.offset = start
                while True:
                    try:
                        data = os.read(fd, _READ)
                    except OSError:
                        data = b""
                    at = time.time()
                    if data:
                        out.write(data)
                        out.flush()
                    new: list[Line] = []
                    index = data.find(b"\n")
                    while index >= 0:
                        new.append(Line(at, start, pending + index + 1))
                        start = pending + index + 1
                        index = data.find(b"\n", index + 1)
                    pending += len(data)
                    if not data and pending > start:  # a last line without its newline
                        new.append(Line(at, start, pending))
                    with self.changed:
                        run.lines.extend(new)
                        run.ended = not data
                        self.changed.notify_all()
                    if not data:
                        return
        finally:
            os.close(fd)
            with self.changed:
                run.ended = True
                self.changed.notify_all()

    def read(self, lines: list[Line], fh: BinaryIO) -> Iterator[tuple[Line, bytes]]:
        for line in lines:
            fh.seek(line.start)
            yield line, fh.read(line.end - line.start)
