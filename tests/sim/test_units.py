"""Table-driven tests of kubesim's pure parts: selectors, patches, field sets and schemas."""

from __future__ import annotations

from typing import Any

import pytest

from kubesim import errors, fields, schema
from kubesim.builtin import builtin_types
from kubesim.patch import merge_patch, strategic_merge_patch
from kubesim.selectors import label_matcher

TYPES = {t.plural: t for t in builtin_types()}


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ("a=b", {"a": "b"}, True),
    ("a=b", {"a": "c"}, False),
    ("a!=b", {}, True),
    ("a in (x, y)", {"a": "y"}, True),
    ("a notin (x)", {"a": "x"}, False),
    ("a", {"a": ""}, True),
    ("!a", {"a": "1"}, False),
    ("a=1,b=2", {"a": "1", "b": "2"}, True),
    ("a=1,b=2", {"a": "1"}, False),
    ("a=", {"a": ""}, True),
])
def test_label_selector(selector: str, labels: dict[str, str], expected: bool) -> None:
    match = label_matcher(selector)
    assert match is not None
    assert match({"metadata": {"labels": labels}}) is expected


@pytest.mark.parametrize("selector", ["a in b", "a in (b", "=b", "a=b=c=", "a notin"])
def test_malformed_label_selector_is_400(selector: str) -> None:
    with pytest.raises(errors.ApiError) as exc:
        label_matcher(selector)
    assert exc.value.code == 400


def test_merge_patch_null_removes_and_objects_merge() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": None, "e": 3}, "d": None}) == {
        "a": {"c": 2, "e": 3}}


def test_strategic_merge_patch_directives() -> None:
    pods = TYPES["pods"]
    live: dict[str, Any] = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}}
    deleted = strategic_merge_patch(pods, live, {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}})
    assert [c["name"] for c in deleted["spec"]["containers"]] == ["b"]
    replaced = strategic_merge_patch(pods, live, {"spec": {"containers": [{"name": "c", "image": "2"},
                                                                          {"$patch": "replace"}]}})
    assert replaced["spec"]["containers"] == [{"name": "c", "image": "2"}]
    assert live["spec"]["containers"][0] == {"name": "a", "image": "1"}  # the input is never modified


def test_field_set_round_trips_through_fields_v1() -> None:
    deploy = TYPES["deployments"]
    obj = {"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {"template": {"spec": {"containers": [
        {"name": "agent", "image": "i", "ports": [{"containerPort": 10623, "protocol": "UDP"}]}]}}}}
    paths = fields.field_set(deploy, obj)
    assert ("f:metadata", "f:labels", "f:a") in paths
    assert ("f:spec", "f:template", "f:spec", "f:containers", 'k:{"name":"agent"}', "f:image") in paths
    assert ("f:spec", "f:template", "f:spec", "f:containers", 'k:{"name":"agent"}', "f:ports",
            'k:{"containerPort":10623,"protocol":"UDP"}', ".") in paths
    assert fields.decode(fields.encode(paths)) == paths


def test_apply_never_modifies_the_live_object() -> None:
    cms = TYPES["configmaps"]
    live = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": "1", "b": "2"}}
    first = fields.apply(cms, live, {"metadata": {"name": "c"}, "data": {"a": "1", "b": "2"}}, "m", "", False,
                         "v1", "t")
    snapshot = {**first, "data": dict(first["data"])}
    second = fields.apply(cms, first, {"metadata": {"name": "c"}, "data": {"a": "1"}}, "m", "", False, "v1", "t")
    assert second["data"] == {"a": "1"}
    assert first["data"] == snapshot["data"]


@pytest.mark.parametrize(("sub", "value", "field"), [
    ({"type": "integer"}, "two", "x"),
    ({"type": "string", "enum": ["a"]}, "b", "x"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "A", "x"),
    ({"type": "array", "items": {"type": "integer"}}, [1, "2"], "x[1]"),
    ({"type": "object", "required": ["y"]}, {}, "x.y"),
    ({"type": "integer", "maximum": 3}, 4, "x"),
])
def test_schema_violations_name_the_field(sub: dict[str, Any], value: Any, field: str) -> None:
    causes: list[dict[str, str]] = []
    schema.validate({"type": "object", "properties": {"x": sub}}, {"x": value}, "", causes)
    assert [c["field"] for c in causes] == [field]


def test_schema_defaults_fill_absent_fields_only() -> None:
    s = {"type": "object", "properties": {"a": {"type": "string", "default": "d"},
                                          "o": {"type": "object", "default": {},
                                                "properties": {"n": {"type": "integer", "default": 1}}}}}
    assert schema.apply_defaults(s, {}) == {"a": "d", "o": {"n": 1}}
    assert schema.apply_defaults(s, {"a": "set"})["a"] == "set"
