"""Kubernetes' protobuf encoding of request bodies, for the few kinds clients are seen sending in it.

client-go's typed clients can send built-in kinds as `application/vnd.kubernetes.protobuf`; Helm's release storage
does (it creates, updates and deletes Secrets that way). The body is the magic `k8s\\0` and a runtime.Unknown whose
`raw` is the object's message (k8s.io/apimachinery/pkg/runtime/serializer/protobuf). kube-apiserver decodes every
built-in kind; kubesim decodes the messages in MESSAGES (field numbers from k8s.io/api and k8s.io/apimachinery
generated.proto) into the JSON form, and answers in JSON, which those clients accept too. Any other kind gets the
415 kube-apiserver gives a protobuf body for a custom resource.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Iterator
from typing import Any

from . import errors

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"

# field number -> (JSON name, type, how): type is a scalar name, a message name or ("map", key, value);
# how is "" (a value type: gogo writes it even when empty, so an empty value means unset), "pointer" (written only
# when set, so kept even when zero) or "repeated".
Field = tuple[str, Any, str]
MESSAGES: dict[str, dict[int, Field]] = {
    "Unknown": {1: ("typeMeta", "TypeMeta", ""), 2: ("raw", "raw", ""), 3: ("contentEncoding", "string", ""),
                4: ("contentType", "string", "")},
    "TypeMeta": {1: ("apiVersion", "string", ""), 2: ("kind", "string", "")},
    "ObjectMeta": {
        1: ("name", "string", ""), 2: ("generateName", "string", ""), 3: ("namespace", "string", ""),
        4: ("selfLink", "string", ""), 5: ("uid", "string", ""), 6: ("resourceVersion", "string", ""),
        7: ("generation", "int64", ""), 8: ("creationTimestamp", "Time", ""),
        9: ("deletionTimestamp", "Time", "pointer"), 10: ("deletionGracePeriodSeconds", "int64", "pointer"),
        11: ("labels", ("map", "string", "string"), ""), 12: ("annotations", ("map", "string", "string"), ""),
        13: ("ownerReferences", "OwnerReference", "repeated"), 14: ("finalizers", "string", "repeated"),
        17: ("managedFields", "ManagedFieldsEntry", "repeated")},
    "OwnerReference": {5: ("apiVersion", "string", ""), 1: ("kind", "string", ""), 3: ("name", "string", ""),
                       4: ("uid", "string", ""), 6: ("controller", "bool", "pointer"),
                       7: ("blockOwnerDeletion", "bool", "pointer")},
    "ManagedFieldsEntry": {1: ("manager", "string", ""), 2: ("operation", "string", ""),
                           3: ("apiVersion", "string", ""), 4: ("time", "Time", "pointer"),
                           6: ("fieldsType", "string", ""), 7: ("fieldsV1", "FieldsV1", "pointer"),
                           8: ("subresource", "string", "")},
    "Secret": {1: ("metadata", "ObjectMeta", ""), 2: ("data", ("map", "string", "bytes"), ""),
               3: ("type", "string", ""), 4: ("stringData", ("map", "string", "string"), ""),
               5: ("immutable", "bool", "pointer")},
    "ConfigMap": {1: ("metadata", "ObjectMeta", ""), 2: ("data", ("map", "string", "string"), ""),
                  3: ("binaryData", ("map", "string", "bytes"), ""), 4: ("immutable", "bool", "pointer")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int64", "pointer"), 2: ("preconditions", "Preconditions", "pointer"),
                      3: ("orphanDependents", "bool", "pointer"), 4: ("propagationPolicy", "string", "pointer"),
                      5: ("dryRun", "string", "repeated"),
                      6: ("ignoreStoreReadErrorWithClusterBreakingPotential", "bool", "pointer")},
    "Preconditions": {1: ("uid", "string", "pointer"), 2: ("resourceVersion", "string", "pointer")},
}
# The kinds a body may hold, by (apiVersion, kind).
KINDS = {("v1", "Secret"): "Secret", ("v1", "ConfigMap"): "ConfigMap", ("v1", "DeleteOptions"): "DeleteOptions",
         ("meta.k8s.io/v1", "DeleteOptions"): "DeleteOptions"}


def unsupported(what: str) -> errors.ApiError:
    return errors.ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           f"accepted media types include: application/json, application/yaml ({what})")


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf request body as the JSON object it stands for."""
    if not body.startswith(MAGIC):
        raise errors.bad_request("the body of the request could not be decoded: no protobuf magic prefix")
    try:
        envelope = _message("Unknown", body[len(MAGIC):])
        type_meta = envelope.get("typeMeta") or {}
        api_version, kind = type_meta.get("apiVersion", ""), type_meta.get("kind", "")
        message = KINDS.get((api_version, kind))
        if message is None:
            raise unsupported(f"kubesim decodes protobuf only for {', '.join(sorted({k for _, k in KINDS}))}; "
                              f"got {api_version} {kind}")
        obj = _message(message, envelope.get("raw") or b"")
    except (IndexError, ValueError) as exc:
        raise errors.bad_request(f"the body of the request could not be decoded: {exc}") from None
    return {"apiVersion": api_version, "kind": kind, **obj}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs: an int for varint and fixed-width fields, bytes for length-delimited ones."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield number, value
        elif wire == 2:
            length, i = _varint(data, i)
            yield number, data[i:i + length]
            i += length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, int.from_bytes(data[i:i + width], "little")
            i += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _scalar(kind: Any, value: int | bytes) -> Any:
    if isinstance(kind, tuple):
        assert isinstance(value, bytes)
        entry = dict(_fields(value))
        return _scalar(kind[1], entry.get(1, b"")), _scalar(kind[2], entry.get(2, b""))
    if kind == "string":
        assert isinstance(value, bytes)
        return value.decode()
    if kind == "bytes":
        assert isinstance(value, bytes)
        return base64.b64encode(value).decode()
    if kind == "raw":
        return value
    if kind == "int64":
        assert isinstance(value, int)
        return value - (1 << 64) if value >= 1 << 63 else value
    if kind == "bool":
        return bool(value)
    if kind == "Time":
        assert isinstance(value, bytes)
        if not value:  # a zero time is written empty
            return None
        seconds = _scalar("int64", dict(_fields(value)).get(1, 0))
        return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if kind == "FieldsV1":
        assert isinstance(value, bytes)
        raw = dict(_fields(value)).get(1, b"")
        return json.loads(raw) if isinstance(raw, bytes) and raw else {}
    assert isinstance(value, bytes)
    return _message(kind, value)


def _message(name: str, data: bytes) -> dict[str, Any]:
    spec = MESSAGES[name]
    out: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in spec:
            continue  # an unknown field, as protobuf skips it
        key, kind, how = spec[number]
        decoded = _scalar(kind, value)
        if isinstance(kind, tuple):
            out.setdefault(key, {})[decoded[0]] = decoded[1]
        elif how == "repeated":
            out.setdefault(key, []).append(decoded)
        elif decoded is not None and (how == "pointer" or decoded not in ("", 0, False, {})):
            out[key] = decoded
    return out
