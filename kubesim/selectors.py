"""Label and field selectors in the string syntax of `labelSelector=` and `fieldSelector=`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import errors
from .resources import ResourceType

Obj = dict[str, Any]


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # =, !=, in, notin, exists, !
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        # != and notin also match objects without the label, as in Kubernetes.
        return not present or labels[self.key] not in self.values


_TOKEN = re.compile(r"\s*(!=|==|=|\(|\)|,|!|[^\s!=(),]+)")


def parse_labels(text: str) -> list[Requirement]:
    tokens = [t for t in _TOKEN.findall(text or "") if t]
    reqs: list[Requirement] = []
    i = 0

    def fail(why: str) -> errors.ApiError:
        return errors.bad_request(f"unable to parse requirement: {why}")

    while i < len(tokens):
        tok = tokens[i]
        if tok == ",":
            i += 1
            continue
        if tok == "!":
            if i + 1 >= len(tokens):
                raise fail("missing key after '!'")
            reqs.append(Requirement(_key(tokens[i + 1]), "!"))
            i += 2
            continue
        key = _key(tok)
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ","
        if nxt == ",":
            reqs.append(Requirement(key, "exists"))
            i += 2
        elif nxt in ("=", "==", "!="):
            if i + 2 >= len(tokens) or tokens[i + 2] in (",", "(", ")"):
                value = ""
                i += 2
            else:
                value = _value(tokens[i + 2])
                i += 3
            reqs.append(Requirement(key, "!=" if nxt == "!=" else "=", (value,)))
        elif nxt in ("in", "notin"):
            if i + 2 >= len(tokens) or tokens[i + 2] != "(":
                raise fail(f"found '{tokens[i + 2] if i + 2 < len(tokens) else ''}', expected: '('")
            j = i + 3
            values: list[str] = []
            while j < len(tokens) and tokens[j] != ")":
                if tokens[j] != ",":
                    values.append(_value(tokens[j]))
                j += 1
            if j >= len(tokens):
                raise fail("found '', expected: ')'")
            reqs.append(Requirement(key, nxt, tuple(values)))
            i = j + 1
        else:
            raise fail(f"found '{nxt}', expected: in, notin, =, ==, !=, gt, lt")
    return reqs


LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _key(text: str) -> str:
    if not LABEL_KEY.match(text):
        raise errors.bad_request(f'unable to parse requirement: invalid label key "{text}"')
    return text


def _value(text: str) -> str:
    if not LABEL_VALUE.match(text):
        raise errors.bad_request(f'unable to parse requirement: invalid label value: "{text}"')
    return text


def label_matcher(text: str | None) -> Callable[[Obj], bool] | None:
    if not text:
        return None
    reqs = parse_labels(text)

    def match(obj: Obj) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(r.matches(labels) for r in reqs)

    return match


def field_matcher(rtype: ResourceType, text: str | None) -> Callable[[Obj], bool] | None:
    if not text:
        return None
    terms: list[tuple[str, str, str]] = []
    for part in _split_unescaped(text):
        if not part:
            continue
        m = re.match(r"^([^!=]+)(==|!=|=)(.*)$", part)
        if not m:
            raise errors.bad_request(f'invalid selector: \'{text}\'; can\'t understand \'{part}\'')
        label, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if not rtype.supports_field(label):
            raise errors.bad_request(f'field label not supported: {label}')
        terms.append((label, "!=" if op == "!=" else "=", value.replace("\\,", ",").replace("\\=", "=")))

    def match(obj: Obj) -> bool:
        for label, op, value in terms:
            actual = field_value(obj, label)
            if (actual == value) != (op == "="):
                return False
        return True

    return match


def selected_name(text: str | None) -> str | None:
    """The name a field selector pins with `metadata.name=NAME` (alone or among other terms), else None: the
    apiserver then reads one key instead of listing (MatchesSingle in the generic registry)."""
    for part in _split_unescaped(text or ""):
        m = re.match(r"^\s*metadata\.name\s*(==|=)(.*)$", part)
        if m:
            return m.group(2).strip().replace("\\,", ",").replace("\\=", "=")
    return None


def _split_unescaped(text: str) -> list[str]:
    parts, cur, escaped = [], "", False
    for ch in text:
        if escaped:
            cur += "\\" + ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def field_value(obj: Obj, label: str) -> str:
    node: Any = obj
    for part in label.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)
