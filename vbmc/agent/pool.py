"""The pool config: the members a pooled agent (`kubevbmc agent --pool`) serves, and where it reads them.

The controller writes the pool's members into one Secret (key `pool.json`, see `parse_pool`); the agent watches
that Secret (or, without a cluster, polls a file about once a second) and offers every change to its runtime
(vbmc/agent/runtime.py), which starts the new members, stops the removed ones and restarts a member whose entry
changed, alone. A member whose entry is unchanged is not touched: its IPMI sessions, Redfish sessions and
connections carry on.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .bmc import BmcSpec

log = logging.getLogger("vbmc.pool")

POOL_KEY = "pool.json"  # the pool Secret's data key
POLL_INTERVAL = 1.0  # seconds between two reads of --pool-file

NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a Kubernetes object name (DNS subdomain)
VM_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # the Redfish System Id (vbmc/redfish/app.py)

# ---- the pool config: pure parsing and validation


class PoolConfigError(ValueError):
    """The pool config cannot be used as a whole; the members already serving are left as they are."""


# JSON key -> (attribute, type, required)
_FIELDS: dict[str, tuple[str, type, bool]] = {
    "name": ("name", str, True),
    "vm": ("vm", str, True),
    "username": ("username", str, True),
    "password": ("password", str, True),
    "ipmiPort": ("ipmi_port", int, True),
    "httpPort": ("http_port", int, True),
    "httpsPort": ("https_port", int, False),
    "ipmi": ("ipmi", bool, True),
    "redfish": ("redfish", bool, True),
    "requireTLS": ("require_tls", bool, False),
    "tlsCert": ("tls_cert", str, False),
    "tlsKey": ("tls_key", str, False),
    "subscriptionsSecret": ("subscriptions_secret", str, False),
    "logConfigMap": ("log_config_map", str, False),
}


def parse_pool(raw: bytes | str, left_out: list[str] | None = None) -> tuple[BmcSpec, ...]:
    """The members of a pool.json document, sorted by name. Raises PoolConfigError naming the first problem:
    not JSON, not `{"members": [...]}`, a member without a required field or with a field of the wrong type, a
    name or VM twice, or a port that two listeners would bind (UDP and TCP counted apart; ports of disabled
    listeners are not bound, so not counted). Keys this version does not know are ignored (a newer controller).
    A member that is well formed but cannot be served (an empty user name or password: a dedicated agent would
    refuse to start) is left out, and why is appended to `left_out`; the others are served."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoolConfigError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("members"), list):
        raise PoolConfigError('not a pool config: expected {"members": [...]}')
    members = [_member(entry, index) for index, entry in enumerate(doc["members"])]
    _check_unique(members)
    usable = []
    for m in members:
        if m.username and m.password:
            usable.append(m)
        elif left_out is not None:
            left_out.append(f"member {m.name} is left out: its user name or password is empty")
    return tuple(sorted(usable, key=lambda m: m.name))


def _member(entry: Any, index: int) -> BmcSpec:
    where = f"members[{index}]"
    if not isinstance(entry, dict):
        raise PoolConfigError(f"{where} is not an object")
    if isinstance(entry.get("name"), str) and entry["name"]:
        where = f"{where} ({entry['name']})"
    values: dict[str, Any] = {}
    for key, (attribute, kind, required) in _FIELDS.items():
        value = entry.get(key)
        if value is None:
            if required:
                raise PoolConfigError(f"{where}: {key} is missing")
            continue
        # bool is an int in Python: a port of `true` is as wrong as one of "623".
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            # The value itself is not logged: it may be a password or a key.
            raise PoolConfigError(f"{where}: {key} must be a {_TYPE_NAMES[kind]}, not a {_json_type(value)}")
        values[attribute] = value
    spec = BmcSpec(**values)
    if not NAME_PATTERN.match(spec.name):
        raise PoolConfigError(f"{where}: name {spec.name!r} is not a Kubernetes object name")
    if not VM_PATTERN.match(spec.vm):
        raise PoolConfigError(f"{where}: vm {spec.vm!r} is not a usable VM name (1-63 letters, digits, . _ -)")
    for key, port, needed in (("ipmiPort", spec.ipmi_port, spec.ipmi), ("httpPort", spec.http_port, True),
                              ("httpsPort", spec.https_port, False)):
        if not 0 <= port <= 65535 or (needed and port == 0):
            raise PoolConfigError(f"{where}: {key} {port} is not a port{' (1-65535)' if needed else ''}")
    return spec


_TYPE_NAMES = {str: "string", int: "number", bool: "boolean"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "object"


def _check_unique(members: Sequence[BmcSpec]) -> None:
    seen: dict[tuple[str, str | int], str] = {}
    for m in members:
        keys: list[tuple[str, str | int]] = [("name", m.name), ("vm", m.vm), ("tcp", m.http_port)]
        if m.ipmi:
            keys.append(("udp", m.ipmi_port))
        if m.serves_https:
            keys.append(("tcp", m.https_port))
        for key in keys:
            other = seen.get(key)
            if other is not None:
                what = {"name": "the name", "vm": "the VM", "tcp": "TCP port", "udp": "UDP port"}[key[0]]
                raise PoolConfigError(f"members {other} and {m.name} both have {what} {key[1]}"
                                      if key[0] in ("tcp", "udp") else f"{what} {key[1]} is in the pool twice")
            seen[key] = m.name


@dataclass(frozen=True)
class Plan:
    """What a new member list asks of the running pool: `stop` (removed or changed), then `start` (new or
    changed). Members in neither are left alone."""

    stop: tuple[str, ...]
    start: tuple[BmcSpec, ...]


def plan(running: Mapping[str, BmcSpec], wanted: Iterable[BmcSpec]) -> Plan:
    wanted_by_name = {m.name: m for m in wanted}
    stop = tuple(sorted(n for n, spec in running.items() if wanted_by_name.get(n) != spec))
    start = tuple(m for n, m in sorted(wanted_by_name.items()) if running.get(n) != m)
    return Plan(stop, start)


def secret_pool_json(secret: Mapping[str, Any] | None) -> bytes | None:
    """pool.json from a Secret object (base64 in .data, as the API serves it); None when absent."""
    data = (secret or {}).get("data") or {}
    raw = data.get(POOL_KEY)
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise PoolConfigError(f"data.{POOL_KEY} is not base64: {exc}") from None


# ---- config sources


class Offers(Protocol):
    """Where a source offers what it read (the runtime's Agent)."""

    def offer(self, raw: bytes | None, source: str) -> None: ...  # a pool.json (None: not there)

    def refuse(self, source: str, problem: str) -> None: ...  # what the source read cannot be used


Source = Callable[[], Callable[[], None]]  # starts reading (on the event loop's thread); returns its stop


def file_source(pool: Offers, path: str) -> Source:
    """--pool-file: read about once a second; a change of content is offered (a missing file: nothing changes)."""

    def start() -> Callable[[], None]:
        stop = threading.Event()

        def read() -> None:
            try:
                pool.offer(Path(path).read_bytes(), path)
            except FileNotFoundError:
                pool.offer(None, path)
            except OSError as exc:
                log.warning("pool: cannot read %s: %s", path, exc)

        def loop() -> None:
            while not stop.wait(POLL_INTERVAL):
                read()

        read()
        threading.Thread(target=loop, name="pool-file", daemon=True).start()
        return stop.set

    return start


def secret_source(pool: Offers, client: Any, namespace: str, name: str) -> Source:
    """--pool-secret: a watch on that one Secret (list and watch with fieldSelector metadata.name, which a Role
    restricted by resourceNames allows), offered at every change."""
    from ..machine.kubevirt.watch import ObjectWatch

    source = f"Secret {namespace}/{name}"

    def changed(secret: Mapping[str, Any] | None) -> None:
        if secret is None:
            log.warning("pool: %s does not exist; the members serve on as they are", source)
            return
        try:
            raw = secret_pool_json(secret)
        except PoolConfigError as exc:
            pool.refuse(source, f"{exc}; nothing changes")
            return
        pool.offer(raw, source)

    def start() -> Callable[[], None]:
        watch = ObjectWatch(client, f"/api/v1/namespaces/{namespace}/secrets", name, on_change=changed)
        watch.start()
        return watch.stop

    return start


