"""Structural schemas of CustomResourceDefinitions: defaulting, pruning and validation.

The order is kube-apiserver's: defaults are applied (a default is applied where a field is absent), unknown
fields are pruned (or rejected with fieldValidation=Strict), then the object is validated and every violation is
reported with its field path.
"""

from __future__ import annotations

import re
from typing import Any

from .objects import ByIdentity, clone

Obj = dict[str, Any]
Cause = dict[str, str]


def apply_defaults(schema: Obj, value: Any, old: Any = None) -> Any:
    """Fill in defaults where fields are absent. What `value` shares with `old` (the stored version, defaulted
    when it was written) is left alone."""
    if isinstance(value, dict):
        if _preserve(schema) and not schema.get("properties"):
            return value
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and isinstance(sub, dict) and "default" in sub:
                value[name] = clone(sub["default"])
        stored = old if isinstance(old, dict) else {}
        for name, child in list(value.items()):
            if stored.get(name) is child:
                continue
            if name in props:
                value[name] = apply_defaults(props[name], child, stored.get(name))
            elif isinstance(schema.get("additionalProperties"), dict):
                value[name] = apply_defaults(schema["additionalProperties"], child, stored.get(name))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _preserve(schema: Obj) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def prune(schema: Obj, value: Any, path: str, unknown: list[str], *, root: bool = False, old: Any = None) -> Any:
    """Drop fields the schema does not declare; their paths are collected in `unknown`. What `value` shares with
    `old` (the stored version, pruned when it was written) is kept as it is."""
    if isinstance(value, dict):
        stored = old if isinstance(old, dict) else {}
        embedded = schema.get("x-kubernetes-embedded-resource") or root
        keep = {"apiVersion", "kind", "metadata"} if embedded else set()
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for name, child in value.items():
            child_path = f"{path}.{name}" if path else name
            if name in keep or stored.get(name) is child:
                out[name] = child
            elif props and name in props:
                out[name] = prune(props[name], child, child_path, unknown, old=stored.get(name))
            elif isinstance(extra, dict):
                out[name] = prune(extra, child, child_path, unknown, old=stored.get(name))
            elif _preserve(schema) or extra is True:
                out[name] = child
            else:
                unknown.append(child_path)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return value


_TYPE_NAMES = {"object": dict, "array": list, "string": str, "boolean": bool}


_NOTHING: Any = object()
META_FIELDS = ("apiVersion", "kind", "metadata")  # checked apart from the schema, as kube-apiserver does
_body_schemas: ByIdentity[Obj] = ByIdentity(limit=1000)


def validate_object(crd_schema: Obj, new: Obj, old: Obj | None, causes: list[Cause]) -> None:
    """Validate a custom resource (without its type and object metadata) against its CRD's schema. On an
    update, values equal to the stored ones are ratcheted (CRDValidationRatcheting, on by default since 1.30):
    only what changed can fail, so a status write checks the status."""
    body_schema = _body_schemas.get(crd_schema, lambda: {**crd_schema, "properties": {
        k: v for k, v in (crd_schema.get("properties") or {}).items() if k not in META_FIELDS}})
    body = {k: v for k, v in new.items() if k not in META_FIELDS}
    stored = _NOTHING if old is None else {k: v for k, v in old.items() if k not in META_FIELDS}
    validate(body_schema, body, "", causes, stored)


def validate(schema: Obj, value: Any, path: str, causes: list[Cause], old: Any = _NOTHING) -> None:
    """Append what `value` breaks to `causes`. With `old` (an update), properties equal to the old ones are
    ratcheted: not validated again, as kube-apiserver does for custom resources since 1.30."""
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            causes.append(_cause(path, f'Invalid value: "null": {path} in body must be of type '
                                       f'{schema["type"]}: "null"', "FieldValueTypeInvalid"))
        return
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            causes.append(_cause(path, f"Invalid value: {_show(value)}: {path} in body must be of type "
                                       "integer or string", "FieldValueTypeInvalid"))
            return
    elif not _type_ok(schema.get("type"), value):
        causes.append(_cause(path, f'Invalid value: "{_type_name(value)}": {path} in body must be of type '
                                   f'{schema.get("type")}: "{_type_name(value)}"', "FieldValueTypeInvalid"))
        return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(_show(v) for v in schema["enum"])
        causes.append(_cause(path, f"Unsupported value: {_show(value)}: supported values: {allowed}",
                             "FieldValueNotSupported"))
    if isinstance(value, str):
        _validate_string(schema, value, path, causes)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _validate_number(schema, value, path, causes)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                causes.append(_cause(f"{path}.{name}" if path else name, "Required value", "FieldValueRequired"))
        stored = old if isinstance(old, dict) else {}
        for name, child in value.items():
            before = stored.get(name, _NOTHING)
            if before is child or (before is not _NOTHING and before == child):
                continue
            child_path = f"{path}.{name}" if path else name
            if name in props:
                validate(props[name], child, child_path, causes, before)
            elif isinstance(schema.get("additionalProperties"), dict):
                validate(schema["additionalProperties"], child, child_path, causes, before)
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            causes.append(_cause(path, f"Too many: {len(value)}: must have at most {schema['maxProperties']} "
                                       "items", "FieldValueTooMany"))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            causes.append(_cause(path, f"Invalid value: {len(value)}: {path} in body should have at least "
                                       f"{schema['minProperties']} properties", "FieldValueInvalid"))
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, child in enumerate(value):
                validate(items, child, f"{path}[{i}]", causes)
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append(_cause(path, f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
                                 "FieldValueTooMany"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(_cause(path, f"Invalid value: {len(value)}: {path} in body should have at least "
                                       f"{schema['minItems']} items", "FieldValueInvalid"))
        _validate_list_keys(schema, value, path, causes)
    for sub in schema.get("allOf") or []:
        validate(sub, value, path, causes)
    if schema.get("anyOf") and not any(_valid(sub, value) for sub in schema["anyOf"]):
        causes.append(_cause(path, f"Invalid value: {_show(value)}: {path} in body must match at least one "
                                   "schema in anyOf", "FieldValueInvalid"))
    if schema.get("oneOf") and sum(1 for sub in schema["oneOf"] if _valid(sub, value)) != 1:
        causes.append(_cause(path, f"Invalid value: {_show(value)}: {path} in body must validate one and "
                                   "only one schema (oneOf)", "FieldValueInvalid"))
    if isinstance(schema.get("not"), dict) and _valid(schema["not"], value):
        causes.append(_cause(path, f"Invalid value: {_show(value)}: {path} in body must not validate the "
                                   "schema (not)", "FieldValueInvalid"))


def _valid(schema: Obj, value: Any) -> bool:
    causes: list[Cause] = []
    validate(schema, value, "", causes)
    return not causes


def _type_ok(kind: Any, value: Any) -> bool:
    if not kind:
        return True
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = _TYPE_NAMES.get(kind)
    return expected is None or isinstance(value, expected)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def _validate_string(schema: Obj, value: str, path: str, causes: list[Cause]) -> None:
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        causes.append(_cause(path, f"Too long: may not be more than {schema['maxLength']} bytes",
                             "FieldValueTooLong"))
    if "minLength" in schema and len(value) < schema["minLength"]:
        causes.append(_cause(path, f'Invalid value: "{value}": {path} in body should be at least '
                                   f'{schema["minLength"]} chars long', "FieldValueInvalid"))
    if "pattern" in schema and not re.search(schema["pattern"], value):
        causes.append(_cause(path, f'Invalid value: "{value}": {path} in body should match '
                                   f"'{schema['pattern']}'", "FieldValueInvalid"))
    if schema.get("format") == "date-time" and not _DATE_TIME.match(value):
        causes.append(_cause(path, f'Invalid value: "{value}": {path} in body must be of type date-time: '
                                   f'"{value}"', "FieldValueInvalid"))


def _validate_number(schema: Obj, value: float, path: str, causes: list[Cause]) -> None:
    if "maximum" in schema:
        limit = schema["maximum"]
        if value > limit or (schema.get("exclusiveMaximum") and value >= limit):
            causes.append(_cause(path, f"Invalid value: {value}: {path} in body should be less than or equal "
                                       f"to {limit}", "FieldValueInvalid"))
    if "minimum" in schema:
        limit = schema["minimum"]
        if value < limit or (schema.get("exclusiveMinimum") and value <= limit):
            causes.append(_cause(path, f"Invalid value: {value}: {path} in body should be greater than or "
                                       f"equal to {limit}", "FieldValueInvalid"))


def _validate_list_keys(schema: Obj, value: list[Any], path: str, causes: list[Cause]) -> None:
    kind = schema.get("x-kubernetes-list-type")
    if kind == "set":
        seen: list[Any] = []
        for i, item in enumerate(value):
            if item in seen:
                causes.append(_cause(f"{path}[{i}]", f"Duplicate value: {_show(item)}", "FieldValueDuplicate"))
            seen.append(item)
    elif kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen_keys: list[Any] = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                continue
            ident = tuple(item.get(k) for k in keys)
            if ident in seen_keys:
                shown = ", ".join(f'"{k}":{_show(item.get(k))}' for k in keys)
                causes.append(_cause(f"{path}[{i}]", f"Duplicate value: map[string]interface {{}}{{{shown}}}",
                                     "FieldValueDuplicate"))
            seen_keys.append(ident)


def _cause(path: str, message: str, reason: str) -> Cause:
    return {"field": path, "message": message, "reason": reason}
