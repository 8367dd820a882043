"""Seeded random and mutated Redfish requests, and what every answer to them must look like.

Shared by tests/redfish/test_hostile.py (a few thousand cases in the test run) and bench/redfish_fuzz.py (larger
runs). A request is built from the service's real paths, methods, property names and values, then some of it is
broken: paths get odd segments and suffixes, bodies random bytes or mutations of valid JSON (deep brackets,
lone surrogates, flipped bits), headers wrong credentials, ETags and content types."""

from __future__ import annotations

import base64
import json
import random
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Any

METHODS = ["GET", "HEAD", "POST", "PATCH", "PUT", "DELETE", "OPTIONS", "TRACE", "BREW", "get", "M-SEARCH"]
NAMES = ["ResetType", "Boot", "BootSourceOverrideTarget", "BootSourceOverrideEnabled", "BootSourceOverrideMode",
         "Image", "Inserted", "WriteProtected", "UserName", "Password", "TransferMethod", "TransferProtocolType",
         "Context", "@odata.etag", "Oem", "\ud800", "\x00", "A" * 300]
TEXTS = ["On", "ForceOff", "GracefulRestart", "Pxe", "Cd", "Once", "UEFI", "http://h/x.iso", "http://[::1/x",
         "https://u:p@h:0/x", "http://h:70000/", "ftp://h/x", "//h/x", "\ud800", "\udfff\ud800", "\x00", "",
         "é" * 100, "%ff", "http://" + "a" * 5000]


# Fragments no JSON encoder writes, spliced in where a value goes.
HOSTILE_VALUES = [b"[" * 1000 + b"]" * 1000, b'{"a":' * 500 + b"1" + b"}" * 500, b"[" * 100000, b'"\\ud800"',
                  b'"\\udfff\\ud800x"', b"NaN", b"-Infinity", b"1e99999", b"9" * 5000, b'"\\u00"', b"tru",
                  b'"' + b"x" * 70000 + b'"']
HOLE = "\x01hole\x01"
# The properties each kind of target reads, so that a good share of bodies reach the code behind parsing.
PROPERTIES = {"Reset": ["ResetType"],
              "InsertMedia": ["Image", "Inserted", "WriteProtected", "UserName", "Password", "TransferMethod",
                              "TransferProtocolType"],
              "Sessions": ["UserName", "Password", "Context"],
              "Systems/": ["Boot"], "Boot": ["BootSourceOverrideTarget", "BootSourceOverrideEnabled",
                                             "BootSourceOverrideMode"],
              "VirtualMedia/": ["Image", "Inserted", "WriteProtected"]}


def natural_method(path: str) -> str:
    if "/Actions/" in path or path.endswith("/Sessions"):
        return "POST"
    if path.rstrip("/").endswith("/Cd") or (path.count("/") == 4 and "/Systems/" in path):
        return "PATCH"
    return "GET"


def properties_for(path: str) -> list[str]:
    for key, names in PROPERTIES.items():
        if key in path and key != "Boot":
            return names
    return NAMES


def service_paths(vm: str) -> list[str]:
    """Every route of the service for VM `vm`, and the probes."""
    system, cd = f"/redfish/v1/Systems/{vm}", "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
    sessions = "/redfish/v1/SessionService/Sessions"
    return ["/redfish", "/redfish/v1", "/redfish/v1/odata", "/redfish/v1/$metadata", "/redfish/v1/Systems", system,
            f"{system}/Actions/ComputerSystem.Reset", f"{system}/EthernetInterfaces", f"{system}/Processors",
            f"{system}/Processors/CPU0", f"{system}/Memory", f"{system}/Memory/DIMM0", f"{system}/SimpleStorage",
            f"{system}/SimpleStorage/1", f"{system}/Storage", f"{system}/Storage/1", "/redfish/v1/Chassis",
            f"/redfish/v1/Chassis/{vm}", f"/redfish/v1/Chassis/{vm}/Drives", "/redfish/v1/Managers",
            "/redfish/v1/Managers/BMC", "/redfish/v1/Managers/BMC/NetworkProtocol",
            "/redfish/v1/Managers/BMC/VirtualMedia", cd, f"{cd}/Actions/VirtualMedia.InsertMedia",
            f"{cd}/Actions/VirtualMedia.EjectMedia", f"{system}/VirtualMedia", f"{system}/VirtualMedia/Cd",
            f"{system}/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia", "/redfish/v1/SessionService", sessions,
            f"{sessions}/1", "/redfish/v1/AccountService", "/redfish/v1/AccountService/Accounts",
            "/redfish/v1/AccountService/Accounts/1", "/redfish/v1/AccountService/Roles",
            "/redfish/v1/AccountService/Roles/Administrator", "/healthz", "/readyz", "/"]


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str  # the request target: path and query, percent-encoded or not
    headers: dict[str, str]
    body: bytes

    def sendable_on_the_wire(self) -> bool:
        """Whether an HTTP/1.1 request line and header block can carry it and the server hands it to the app:
        the rest is refused below Flask (the HTTP layer's part of issue 11), and tested in process."""
        text = self.path + "".join(self.headers.values())
        return (self.method.isupper() and self.path.startswith("/") and all(ord(c) <= 255 for c in text)
                and not any(c in self.path for c in " \r\n\x7f") and "Transfer-Encoding" not in self.headers)


class Fuzzer:
    def __init__(self, seed: int, vm: str, username: str, password: str) -> None:
        self.rng = random.Random(seed)
        self.paths = service_paths(vm)
        self.auth = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        self.texts = [*TEXTS, username, password]

    def request(self) -> FuzzRequest:
        path = self.path()
        method = natural_method(path) if self.rng.random() < 0.6 else self.rng.choice(METHODS)
        return FuzzRequest(method, path, self.headers(), self.body(path))

    def value(self, depth: int = 0, names: list[str] = NAMES) -> Any:
        rng = self.rng
        kind = rng.randrange(10 if depth < 4 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice([True, False])
        if kind == 2:
            return rng.choice([0, -1, 2**64, 1.5, float("inf"), float("nan"), -0.0])
        if kind in (3, 4, 5):
            return rng.choice(self.texts)
        if kind == 6:
            return {rng.choice(PROPERTIES["Boot"]): self.value(depth + 1) for _ in range(rng.randrange(4))}
        if kind == 7:
            return {rng.choice(names): self.value(depth + 1) for _ in range(rng.randrange(4))}
        if kind == 8:
            return HOLE
        return [self.value(depth + 1) for _ in range(rng.randrange(4))]

    def mutate(self, data: bytes) -> bytes:
        rng, buf = self.rng, bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            op, pos = rng.randrange(4), rng.randrange(len(buf) + 1)
            if op == 0 and buf:
                del buf[pos % len(buf)]
            elif op == 1:
                buf[pos:pos] = bytes([rng.randrange(256)])
            elif op == 2:
                piece = rng.choice([b"{", b"[", b"}", b"]", b'"', b"\\", b"\\u", b"\\ud800", b",", b":", b'{"a":'])
                buf[pos:pos] = piece * rng.choice([1, 2, 50, 2000])
            elif buf:
                buf[pos % len(buf)] ^= 1 << rng.randrange(8)
        return bytes(buf)

    def body(self, path: str) -> bytes:
        rng = self.rng
        kind = rng.randrange(8)
        if kind == 0:
            return b""
        if kind == 1:
            return rng.randbytes(rng.randrange(1, 200))
        names = properties_for(path) if kind > 2 else NAMES
        doc = {rng.choice(names): self.value(names=names) for _ in range(rng.randrange(1, 4))}
        data = json.dumps(doc).encode()
        # Holes become hostile fragments, or plain values when the body should otherwise be valid.
        hole = json.dumps(HOLE).encode()
        while hole in data:
            fill = rng.choice(HOSTILE_VALUES) if kind in (4, 5, 6) else json.dumps(rng.choice(self.texts)).encode()
            data = data.replace(hole, fill, 1)
        return self.mutate(data) if kind == 2 else data

    def path(self) -> str:
        rng = self.rng
        path = rng.choice(self.paths)
        kind = rng.randrange(8)
        if kind == 0:
            return path + rng.choice(["/", "//", "/..", "/%2e%2e", "/%00", "/%ff", "?$expand=*", "?$top=-1", "#x",
                                      "/" + "A" * 3000, "/\u2603", ";x=1"])
        if kind == 1:
            parts = path.split("/")
            parts[rng.randrange(len(parts))] = rng.choice(["", "..", "%", "%zz", "x" * 100, "CPU99", "\x7f"])
            return "/".join(parts) or "/"
        return path

    def headers(self) -> dict[str, str]:
        rng = self.rng
        headers: dict[str, str] = {}
        auth = rng.randrange(6)
        if auth in (0, 1, 2):
            headers["Authorization"] = self.auth
        elif auth == 3:
            headers["Authorization"] = rng.choice([
                "Basic", "Basic !!!", "Basic " + base64.b64encode(b"\xff\xfe:\xff").decode(), "Bearer x",
                "Basic " + base64.b64encode(b"admin").decode(), "Digest a=b"])
        elif auth == 4:
            headers["X-Auth-Token"] = rng.choice(["", "x" * 500, "\xff", "0" * 32])
        if rng.random() < 0.3:
            headers["If-Match"] = rng.choice(["*", '"x"', "W/", ",,,", '"' * 100, "\xe9"])
        if rng.random() < 0.3:
            headers["Content-Type"] = rng.choice(["text/plain", "application/json; charset=latin-1",
                                                  "multipart/form-data; boundary=x",
                                                  "application/x-www-form-urlencoded", ""])
        if rng.random() < 0.1:
            headers["Host"] = rng.choice(["", "[::1", "a" * 300, "h:99999", "x:y:z", "\xe9", "127.0.0.1:0"])
        if rng.random() < 0.1:
            headers[rng.choice(["Accept", "OData-Version", "If-None-Match", "Cookie", "X-Forwarded-For",
                                "Content-Encoding"])] = rng.choice(["", "*/*", "4.0", "\xff" * 10, "gzip", "a=b;;;"])
        if rng.random() < 0.1:
            headers["Transfer-Encoding"] = "chunked"
        return headers


def wsgi_path(target: str) -> dict[str, str]:
    """PATH_INFO and QUERY_STRING as a server hands them to the app (PEP 3333: percent-decoded bytes, as
    latin-1), for any request target, even one the test client would read as a URL with a host."""
    path, _, query = target.partition("?")
    return {"PATH_INFO": urllib.parse.unquote_to_bytes(path).decode("latin-1"), "QUERY_STRING": query}


def send_raw(port: int, method: str, path: str, body: bytes = b"", *,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request over a fresh connection, the body sent byte for byte (urllib would re-encode it)."""
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
            "Connection": "close", **(headers or {})}
    request = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode("latin-1") + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head_raw, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *lines = head_raw.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), fields, payload


def answer_problem(method: str, status: int, content_type: str, data: bytes) -> str | None:
    """What is wrong with an answer, or None: no 5xx but 503 (busy) and 501 (DSP0266's answer to an unsupported
    query parameter), and a Redfish error body on every error."""
    if status >= 500 and status not in (501, 503):
        return f"status {status}"
    if status < 400 or method.upper() == "HEAD":
        return None
    if not content_type.startswith("application/json"):
        return f"status {status} with content type {content_type!r}"
    try:
        error = json.loads(data)["error"]
        if not (error["code"].startswith("Base.1.") and error["@Message.ExtendedInfo"]):
            return f"status {status} with an error body without a Base message: {error!r:.200}"
    except (ValueError, KeyError, TypeError):
        return f"status {status} without a Redfish error body: {data[:200]!r}"
    return None
