"""CRD validation rules (`x-kubernetes-validations`): compiled and evaluated with CEL as kube-apiserver does.

The shape follows k8s.io/apiextensions-apiserver (1.33+):
- pkg/apiserver/schema/cel/validation.go: a tree of compiled rules parallel to the schema; `self` is the value at
  the rule's node, `oldSelf` its correlated old value (object fields by name, items of map-type lists by key,
  nothing else). A rule that references `oldSelf` is a transition rule: it runs only on update and only where an
  old value correlates, unless `optionalOldSelf` makes `oldSelf` an optional. A failure is a field error at the
  node's path (plus the rule's `fieldPath`) with the rule's `reason`, and the message text of validation.go.
- Ratcheting (CRDValidationRatcheting, GA in 1.33): a failing rule that does not use `oldSelf`, on a value equal
  to its correlated old value (pkg/cel/common/equality.go), does not fail the update.
- pkg/registry/customresource/strategy.go: rules run after structural validation and not at all when that found
  a type, required, enum or size error (hasBlockingErr): one cause says so instead.
- pkg/apis/apiextensions/validation/validation.go: a CRD whose rules do not compile is refused at create and
  update, with the field path and message the apiserver gives (its cel-go type checker is approximated here:
  syntax, undeclared identifiers and functions, undefined fields of declared objects).

cel-python (celpy) does the parsing and evaluation. It is imported only when a CRD has rules, so a simulator
without such CRDs starts without it. Its CompiledRunner transpiles a rule to Python once; evaluation runs that
code with a scope of our own instead of celpy's Activation, whose name resolution costs ten times the rule.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import json
import logging
import operator
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import errors, schema

Obj = dict[str, Any]
Cause = dict[str, str]

RULES = "x-kubernetes-validations"
SUPPORTED_REASONS = ("FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired")
# hasBlockingErr: structural errors that leave values of unexpected types, so rules are not run at all.
BLOCKING_REASONS = frozenset({"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong",
                              "FieldValueTooMany", "FieldValueTypeInvalid"})
NOT_CHECKED = ("some validation rules were not checked because the object was invalid; correct the existing "
               "errors to complete validation")
MAX_MESSAGE_BYTES = 5 * 1024  # celconfig.MaxEvaluatedMessageExpressionSizeBytes
MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
# Identifiers every rule may use besides self, oldSelf and macro variables: CEL's type names.
TYPE_NAMES = frozenset({"bool", "bytes", "double", "duration", "int", "list", "map", "null_type", "string",
                        "timestamp", "type", "uint", "dyn"})
# What `self` shows of the metadata of a resource root or embedded resource (model.WithTypeAndObjectMeta).
_OBJECT_META = {"type": "object", "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}}}

_PACKAGE = __name__.split(".")[0]


# ---- the rule tree of a CRD version


def has_rules(root: Any) -> bool:
    """Whether a schema has `x-kubernetes-validations` anywhere (NewValidator returns nil when not).

    A loop rather than recursion: KubeVirt's schemas have thousands of nodes and are walked at every start."""
    stack = [root] if isinstance(root, dict) else []
    while stack:
        node = stack.pop()
        if node.get(RULES):
            return True
        stack.extend(v for v in (node.get("properties") or {}).values() if isinstance(v, dict))
        stack.extend(v for v in (node.get("items"), node.get("additionalProperties")) if isinstance(v, dict))
        stack.extend(v for v in node.get("allOf") or () if isinstance(v, dict))
    return False


@dataclass(frozen=True)
class Rule:
    rule: str
    message: str
    reason: str
    field_path: str  # normalised, "" for none
    optional_old_self: bool
    uses_old_self: bool
    program: Program | None  # None: an empty rule, or one that failed to compile
    message_program: Program | None
    compile_error: str

    @property
    def error_text(self) -> str:
        """ruleErrorString: the message if there is one, else the rule."""
        return self.message or self.rule.strip()


@dataclass
class Node:
    """The rules at one schema node and the nodes below it that have rules (cel.Validator)."""

    schema: Obj
    resource: bool  # the root of a resource or of an embedded resource: `self` has apiVersion, kind, metadata
    rules: tuple[Rule, ...] = ()
    properties: dict[str, Node] = field(default_factory=dict)
    items: Node | None = None
    additional: Node | None = None
    all_of: tuple[Node, ...] = ()

    @property
    def type_name(self) -> str:
        return str(self.schema.get("type") or "")

    @property
    def uses_old_self(self) -> bool:
        return any(r.uses_old_self for r in self.rules)

    @functools.cached_property
    def transitions_below(self) -> bool:
        """Whether this node or one below it has a transition rule (the only kind an unchanged value can fail)."""
        return self.uses_old_self or any(n.transitions_below for n in (
            *self.properties.values(), *self.all_of, *(n for n in (self.items, self.additional) if n is not None)))


def rule_tree(validation: Obj, node_schema: Obj, resource: bool) -> Node | None:
    """Compile the rules of `validation` (a schema or an allOf branch) applied to values of `node_schema`."""
    rules = tuple(compile_rule(raw, node_schema, resource) for raw in validation.get(RULES) or []
                  if isinstance(raw, dict))
    node = Node(node_schema, resource, rules)
    node_props = node_schema.get("properties") or {}
    for name, sub in (validation.get("properties") or {}).items():
        target = node_props.get(name)
        if isinstance(sub, dict) and isinstance(target, dict):
            child = rule_tree(sub, target, _embedded(target))
            if child is not None:
                node.properties[name] = child
    for key in ("items", "additionalProperties"):
        sub, target = validation.get(key), node_schema.get(key)
        if isinstance(sub, dict) and isinstance(target, dict):
            child = rule_tree(sub, target, _embedded(target))
            if key == "items":
                node.items = child
            else:
                node.additional = child
    node.all_of = tuple(n for sub in validation.get("allOf") or [] if isinstance(sub, dict)
                        for n in [rule_tree(sub, node_schema, resource)] if n is not None)
    if rules or node.properties or node.items or node.additional or node.all_of:
        return node
    return None


def _embedded(node_schema: Obj) -> bool:
    return bool(node_schema.get("x-kubernetes-embedded-resource"))


def compile_rule(raw: Obj, node_schema: Obj, resource: bool) -> Rule:
    text = str(raw.get("rule") or "")
    message = str(raw.get("message") or "").strip()
    parsed = parse(text) if text.strip() else None
    issues = rule_issues(parsed, node_schema, resource) if parsed else ""
    message_program = None
    if parsed and not issues and str(raw.get("messageExpression") or "").strip():
        message_parsed = parse(str(raw["messageExpression"]))
        if not rule_issues(message_parsed, node_schema, resource):
            message_program = message_parsed.program
    return Rule(
        rule=text, message=message, reason=str(raw.get("reason") or ""),
        field_path=field_path(str(raw.get("fieldPath") or ""), _self_schema(node_schema, resource)) or "",
        optional_old_self=bool(raw.get("optionalOldSelf")),
        uses_old_self=bool(parsed and not issues and parsed.uses_old_self),
        program=None if issues or not parsed else parsed.program, message_program=message_program,
        compile_error=f"compilation failed: {issues}" if issues else "")


# ---- evaluation on a write


class RuleValidator:
    """A CRD version's rules, run on every write of its objects (a ResourceType.validator: (new, old) -> causes).

    Built once per CRD version; the programs are compiled then (and cached by text across versions)."""

    def __init__(self, crd_schema: Obj, tree: Node) -> None:
        self.schema = crd_schema
        self.tree = tree

    def __call__(self, new: Obj, old: Obj | None, structural: list[Cause] | None = None) -> list[Cause]:
        """The rules' causes. `structural`: what the store's schema validation found, when it ran already."""
        if self._blocked(new, structural):
            return [_invalid("", "null", NOT_CHECKED)]
        run = _Run()
        ratchet = _Ratchet(_Correlated(new, old, self.schema)) if old is not None else _Ratchet()
        validate(self.tree, "", new, old, ratchet, run)
        return run.causes

    def _blocked(self, new: Obj, structural: list[Cause] | None) -> bool:
        if structural is None:
            structural = []
            schema.validate_object(self.schema, new, None, structural)
        return any(c.get("reason") in BLOCKING_REASONS for c in structural)


def rule_validator(crd_schema: Obj | None) -> RuleValidator | None:
    """The validator of a served CRD version, or None when its schema has no rules (celpy is not loaded then)."""
    if not isinstance(crd_schema, dict) or not has_rules(crd_schema):
        return None
    engine()
    tree = rule_tree(crd_schema, crd_schema, True)
    return RuleValidator(crd_schema, tree) if tree is not None else None


@dataclass
class _Run:
    causes: list[Cause] = field(default_factory=list)


def validate(node: Node, path: str, new: Any, old: Any, ratchet: _Ratchet, run: _Run) -> None:
    """Validator.validate: this node's rules, its allOf branches, then the correlated children."""
    if new is None:
        return
    if old is not None and not node.transitions_below and ratchet.unchanged():
        return  # ratcheted: no rule here or below can fail on an unchanged value
    if node.rules:
        _evaluate(node, path, new, old, ratchet, run)
    for branch in node.all_of:
        validate(branch, path, new, old, _Ratchet(None, ratchet.nearest), run)
    if isinstance(new, list) and node.items is not None:
        old_items = _ListIndex(node.schema, old)
        for i, item in enumerate(new):
            validate(node.items, f"{path}[{i}]", item, old_items.get(item), ratchet.index(i), run)
    elif isinstance(new, dict):
        old_map = old if isinstance(old, dict) else {}
        if node.additional is not None:
            for key, value in new.items():
                validate(node.additional, f"{path}[{key}]", value, old_map.get(key), ratchet.key(key), run)
        for key, value in new.items():
            sub = node.properties.get(key)
            if sub is not None:
                validate(sub, f"{path}.{key}" if path else key, value, old_map.get(key), ratchet.key(key), run)


def _evaluate(node: Node, path: str, new: Any, old: Any, ratchet: _Ratchet, run: _Run) -> None:
    """validateExpressions: the rules of one node against one value.

    A rule without oldSelf on an unchanged value is ratcheted: its failure would only be a warning, which kubesim
    does not send, so it is not evaluated at all."""
    unchanged = old is not None and ratchet.unchanged()
    if unchanged and not node.uses_old_self:
        return
    this = to_cel(node.schema, new, node.resource)
    before = to_cel(node.schema, old, node.resource) if old is not None and node.uses_old_self else None
    for rule in node.rules:
        if rule.compile_error:
            run.causes.append(_invalid(path, node.type_name, f"rule compile error: {rule.compile_error}"))
            continue
        if rule.program is None:
            continue
        if rule.uses_old_self and old is None and not rule.optional_old_self:
            continue  # transition rules run only where an old value correlates
        if unchanged and not rule.uses_old_self:
            continue
        variables = {"self": this}
        if rule.uses_old_self:
            variables["oldSelf"] = OptionalValue(before, old is not None) if rule.optional_old_self else before
        try:
            value = rule.program.evaluate(variables)
        except EvaluationError as exc:
            run.causes.append(_invalid(path, node.type_name, exc.describe(rule)))
            continue
        if _is_true(value):
            continue
        where = _child(path, rule.field_path) if rule.field_path else path
        # The messageExpression sees oldSelf as a plain value, unset on create, even for optionalOldSelf rules.
        plain = {"self": this, **({"oldSelf": before} if before is not None else {})}
        run.causes.append(_failure(where, node.type_name, _message(rule, plain), rule.reason))


def _is_true(value: Any) -> bool:
    """Only a boolean true passes (`evalResult == types.True`)."""
    return value is True or (isinstance(value, engine().types.Bool) and bool(value))


def _message(rule: Rule, variables: dict[str, Any]) -> str:
    """The messageExpression's value when it gives a usable one, else the message, else `failed rule: ...`."""
    if rule.message_program is not None:
        try:
            text = rule.message_program.evaluate(variables)
        except EvaluationError:
            text = None
        if isinstance(text, str):
            text = text.strip()
            if text and "\n" not in text and len(text.encode()) <= MAX_MESSAGE_BYTES:
                return text
    return rule.message or f"failed rule: {rule.rule.strip()}"


def _failure(path: str, type_name: str, detail: str, reason: str) -> Cause:
    """fieldErrorForReason, rendered as field.Error.ErrorBody."""
    if reason == "FieldValueForbidden":
        return _cause(path, f"Forbidden: {detail}", reason)
    if reason == "FieldValueRequired":
        return _cause(path, f"Required value: {detail}", reason)
    if reason == "FieldValueDuplicate":
        return _cause(path, f"Duplicate value: {_quote(type_name)}", reason)
    return _invalid(path, type_name, detail)


def _invalid(path: str, value: str, detail: str) -> Cause:
    """field.Invalid with a string value (a nil value prints as "null" too)."""
    return _cause(path, f"Invalid value: {_quote(value)}: {detail}", "FieldValueInvalid")


def _cause(path: str, message: str, reason: str) -> Cause:
    # A nil field.Path prints as "<nil>": that is the field of an error at the root of the object.
    return {"field": path or "<nil>", "message": message, "reason": reason}


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ---- old values: correlation for oldSelf and for ratcheting


class _ListIndex:
    """The old items of a map-type list by key (makeMapList); any other list correlates nothing for oldSelf."""

    def __init__(self, list_schema: Obj, old: Any) -> None:
        self.keys: tuple[str, ...] = ()
        self.by_key: dict[tuple[Any, ...], Any] = {}
        if list_schema.get("x-kubernetes-list-type") == "map" and isinstance(old, list):
            self.keys = tuple(list_schema.get("x-kubernetes-list-map-keys") or ())
            for item in old:
                if isinstance(item, dict):
                    self.by_key.setdefault(self.key(item), item)

    def key(self, item: Obj) -> tuple[Any, ...]:
        return tuple(item.get(k) for k in self.keys)  # map keys are scalars

    def get(self, item: Any) -> Any:
        if not self.keys or not isinstance(item, dict):
            return None
        return self.by_key.get(self.key(item))


class _Correlated:
    """A new value with its correlated old value (common.CorrelatedObject), with a cached deep comparison."""

    __slots__ = ("_children", "_equal", "_old_items", "new", "old", "schema")

    def __init__(self, new: Any, old: Any, node_schema: Obj | None) -> None:
        self.new, self.old, self.schema = new, old, node_schema
        self._equal: bool | None = None
        self._children: dict[Any, _Correlated | None] = {}
        self._old_items: _ListIndex | None = None

    def key(self, name: str) -> _Correlated | None:
        if name not in self._children:
            self._children[name] = self._key(name)
        return self._children[name]

    def _key(self, name: str) -> _Correlated | None:
        if self.schema is None or not isinstance(self.new, dict) or not isinstance(self.old, dict):
            return None
        if name not in self.new or name not in self.old:
            return None
        sub = (self.schema.get("properties") or {}).get(name)
        if sub is None and isinstance(self.schema.get("additionalProperties"), dict):
            sub = self.schema["additionalProperties"]
        return _Correlated(self.new[name], self.old[name], sub) if isinstance(sub, dict) else None

    def index(self, i: int) -> _Correlated | None:
        if i not in self._children:
            self._children[i] = self._index(i)
        return self._children[i]

    def _index(self, i: int) -> _Correlated | None:
        if self.schema is None or not isinstance(self.new, list) or not isinstance(self.old, list):
            return None
        if i >= len(self.new) or not isinstance(self.schema.get("items"), dict):
            return None
        kind = self.schema.get("x-kubernetes-list-type")
        if kind == "map":
            if self._old_items is None:
                self._old_items = _ListIndex(self.schema, self.old)
            old_item = self._old_items.get(self.new[i])
        elif kind in ("set", "atomic") or i >= len(self.old):
            return None
        else:  # no list type: by index
            old_item = self.old[i]
        return None if old_item is None else _Correlated(self.new[i], old_item, self.schema["items"])

    def equal(self) -> bool:
        """CachedDeepEqual: map-type lists compare by key, so reordering them changes nothing."""
        if self._equal is None:
            self._equal = self._compare()
        return self._equal

    def _compare(self) -> bool:
        new, old = self.new, self.old
        if new is old:
            return True  # the store shares what a write did not touch with the stored version
        if new is None or old is None:
            return new is None and old is None
        if isinstance(new, list) and isinstance(old, list):
            if len(new) != len(old):
                return False
            for i in range(len(new)):
                child = self.index(i)
                if child is None:
                    return self._old_items is None and _same(new, old)
                if not child.equal():
                    return False
            return True
        if isinstance(new, dict) and isinstance(old, dict):
            if len(new) != len(old):
                return False
            return all((child := self.key(k)) is not None and child.equal() for k in new)
        return _same(new, old)


def _same(a: Any, b: Any) -> bool:
    """reflect.DeepEqual on JSON values: 1 and 1.0 and true differ."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclass(frozen=True)
class _Ratchet:
    """ratchetingOptions: the node's correlation, or the nearest correlated ancestor's when it has none."""

    current: _Correlated | None = None
    nearest: _Correlated | None = None

    def key(self, name: str) -> _Ratchet:
        if self.current is None:
            return self
        if self.nearest is None and name in ("apiVersion", "kind"):
            return _Ratchet()  # both sides are converted to the same version: never ratcheted
        return _Ratchet(self.current.key(name), self.current)

    def index(self, i: int) -> _Ratchet:
        if self.current is None:
            return self
        return _Ratchet(self.current.index(i), self.current)

    def unchanged(self) -> bool:
        if self.current is not None:
            return self.current.equal()
        return self.nearest is not None and self.nearest.equal()


# ---- values as CEL sees them (UnstructuredToVal)


def to_cel(node_schema: Obj, value: Any, resource: bool = False) -> Any:
    """A JSON value as the CEL value of its schema type: integers, doubles, timestamps and durations by format,
    objects with their declared fields only (null fields are absent), maps and lists by their item schema."""
    types = engine().types
    if value is None:
        return None
    if node_schema.get("x-kubernetes-int-or-string") or (not node_schema.get("type") and not resource):
        return _json_to_cel(value)
    kind = "object" if resource else node_schema.get("type")
    if kind == "object" and isinstance(value, dict):
        return _object_to_cel(node_schema, value, resource)
    if kind == "array" and isinstance(value, list):
        items: Obj = node_schema["items"] if isinstance(node_schema.get("items"), dict) else {}
        lst = types.UnorderedList if node_schema.get("x-kubernetes-list-type") in ("set", "map") else types.List
        return lst([to_cel(items, v, _embedded(items)) for v in value])
    if kind == "string" and isinstance(value, str):
        return _string_to_cel(str(node_schema.get("format") or ""), value)
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return types.Int(int(value))
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return types.Double(float(value))
    return _json_to_cel(value)


def _object_to_cel(node_schema: Obj, value: Obj, resource: bool) -> Any:
    props = _self_schema(node_schema, resource).get("properties")
    if props:
        return _map({_name(k): to_cel(props[k], v, _embedded(props[k]))
                     for k, v in value.items() if k in props and v is not None})
    extra = node_schema.get("additionalProperties")
    if isinstance(extra, dict):
        string = engine().types.String
        return _map({string(k): to_cel(extra, v, _embedded(extra)) for k, v in value.items()})
    return _json_to_cel(value)


def _map(items: dict[Any, Any]) -> Any:
    """A celpy MapType, without its constructor's checks (a third of the cost of converting an object)."""
    cel_map = engine().types.Map()
    dict.update(cel_map, items)
    return cel_map


_NAMES: dict[str, Any] = {}  # declared field names as CEL strings (bounded by the schemas)


def _name(text: str) -> Any:
    name = _NAMES.get(text)
    if name is None:
        name = _NAMES[text] = engine().types.String(text)
    return name


def _self_schema(node_schema: Obj, resource: bool) -> Obj:
    """The schema of `self`: a resource root also declares apiVersion, kind and metadata.name/generateName."""
    if not resource:
        return node_schema
    props = dict(node_schema.get("properties") or {})
    props.update({"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": _OBJECT_META})
    return {**node_schema, "type": "object", "properties": props}


def _string_to_cel(fmt: str, value: str) -> Any:
    types = engine().types
    try:
        if fmt in ("date-time", "date"):
            return types.Timestamp(value if fmt == "date-time" else f"{value}T00:00:00Z")
        if fmt == "duration":
            return types.Duration(value)
        if fmt == "byte":
            return types.Bytes(base64.b64decode(value, validate=True))
    except (ValueError, TypeError, binascii.Error):
        pass
    return types.String(value)


def _json_to_cel(value: Any) -> Any:
    return engine().json_to_cel(value)


class OptionalValue:
    """The value of `oldSelf` for a rule with optionalOldSelf: none on create, else the old value."""

    __slots__ = ("present", "value")

    def __init__(self, value: Any, present: bool) -> None:
        self.value, self.present = value, present

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptionalValue) and (self.present, self.value) == (other.present, other.value)

    def __hash__(self) -> int:
        return hash(self.present)


# ---- the CEL engine (celpy, imported on first use)


class EvaluationError(Exception):
    """A rule that evaluated to an error (no such key, no such overload, division by zero...)."""

    def describe(self, rule: Rule) -> str:
        text = str(self)
        if text.startswith("no such overload"):
            return (f"'{text}': call arguments did not match a supported operator, function or macro signature for "
                    f"rule: {rule.error_text}")
        return f"{text} evaluating rule: {rule.error_text}"


@dataclass(frozen=True)
class _Types:
    """celpy's value types, bound once celpy is loaded."""

    Bool: Any
    Bytes: Any
    Double: Any
    Duration: Any
    Int: Any
    List: Any
    UnorderedList: Any
    Map: Any
    String: Any
    Timestamp: Any


class Engine:
    def __init__(self) -> None:
        try:
            import celpy
            import lark
            from celpy import celtypes
            from celpy.adapter import json_to_cel
            from celpy.celparser import CELParser
            from celpy.evaluation import CELEvalError, TranspilerTree, base_functions
        except ImportError as exc:
            raise errors.internal(
                "kubesim cannot serve this CustomResourceDefinition: its x-kubernetes-validations rules need "
                f"cel-python, which is not installed ({exc}); install kubevbmc with the `sim` extra "
                "(pip install 'kubevbmc[sim]')") from None
        # CompiledRunner logs every transpiled rule at INFO and every failing evaluation at ERROR.
        logging.getLogger("celpy").setLevel(logging.WARNING)
        self.env = celpy.Environment(runner_class=celpy.CompiledRunner)
        # A parser of our own: celpy's is one per process, with the tree type of whoever made it first (an
        # interpreted Environment's trees cannot be transpiled). Same grammar and options as celpy's.
        self.parser = lark.Lark(
            (Path(celpy.__file__).parent / "cel.lark").read_text(encoding="utf-8"), parser="lalr", start="expr",
            g_regex_flags=re.M, lexer_callbacks={"IDENT": CELParser.ambiguous_literals}, propagate_positions=True,
            maybe_placeholders=False, priority="invert", tree_class=TranspilerTree)
        self.parse_error: type[Exception] = lark.exceptions.UnexpectedInput
        self.eval_error: type[Exception] = CELEvalError
        self.json_to_cel: Callable[[Any], Any] = json_to_cel
        self.types = _Types(
            Bool=celtypes.BoolType, Bytes=celtypes.BytesType, Double=celtypes.DoubleType,
            Duration=celtypes.DurationType, Int=celtypes.IntType, List=celtypes.ListType,
            UnorderedList=_unordered_list(celtypes.ListType), Map=celtypes.MapType, String=celtypes.StringType,
            Timestamp=celtypes.TimestampType)
        self.type_values = {name: base_functions[name] for name in TYPE_NAMES if name in base_functions}
        self.known_functions = frozenset(base_functions) | frozenset(LIBRARY)
        # The globals the transpiled code refers to: celpy's modules, and this package for LIBRARY's functions.
        self.namespace = {"celpy": celpy, "operator": operator, "CELEvalError": CELEvalError,
                          _PACKAGE: sys.modules[_PACKAGE]}
        self.lock = threading.Lock()  # for the parser and the transpiler


@functools.cache
def engine() -> Engine:
    return Engine()


def _unordered_list(list_type: type) -> type:
    class UnorderedList(list_type):
        """A set or map-type list: CEL equality ignores the order of its items."""

        def __eq__(self, other: Any) -> bool:
            if not isinstance(other, list):
                return bool(super().__eq__(other))
            return len(self) == len(other) and all(x in other for x in self) and all(y in self for y in other)

        def __ne__(self, other: Any) -> bool:
            return not self.__eq__(other)

        __hash__ = None  # type: ignore[assignment]

    return UnorderedList


class _Scope:
    """The activation the transpiled code reads: `activation.self`, macro variables in nested scopes, and the
    type names (`int`, `map`, ...). celpy's own Activation resolves names through type-annotated containers."""

    __slots__ = ("_parent", "_values")

    def __init__(self, values: dict[str, Any], parent: _Scope | None = None) -> None:
        self._values = values
        self._parent = parent

    def __getattr__(self, name: str) -> Any:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope._values:
                return scope._values[name]
            scope = scope._parent
        if name in engine().type_values:
            return engine().type_values[name]
        raise NameError(name)

    get = __getattr__
    resolve_variable = __getattr__

    def nested_activation(self, annotations: Any = None, vars: dict[str, Any] | None = None) -> _Scope:
        return _Scope(dict(vars or {}), self)


class Program:
    """One compiled CEL expression: celpy's transpiled Python, defined once and called per evaluation.

    The transpiled code is a series of `ex_N = lambda activation: ...` that take the activation as a parameter,
    ending with `CEL = result(base_activation, ex_1)`; that last line becomes a function of base_activation, so
    an evaluation is a call (thread-safe, no exec) rather than celpy's exec into its module's globals."""

    def __init__(self, source: str) -> None:
        body, found = _RESULT.subn(r"def _cel_main(base_activation):\n    return \1", source)
        if found != 1:
            raise ValueError("unexpected transpiled code")
        namespace = dict(engine().namespace)
        exec(compile(body, "<cel>", "exec"), namespace)
        self._main: Callable[[_Scope], Any] = namespace["_cel_main"]  # type: ignore[assignment]

    def evaluate(self, variables: dict[str, Any]) -> Any:
        try:
            value = self._main(_Scope(variables))
        except Exception as exc:  # the transpiled code lets some Python errors through (a field of a list...)
            raise EvaluationError(f"no such overload: {exc}") from None
        if isinstance(value, engine().eval_error):
            raise EvaluationError(_error_text(value)) from None
        return value


_RESULT = re.compile(r"^CEL = (celpy\.evaluation\.result\(base_activation, .*\))$", re.M)


def _error_text(error: Any) -> str:
    """cel-go's wording for celpy's errors."""
    message, kind, args = [*error.args, None, None, None][:3]
    args = args or ()
    if kind is KeyError and args:
        return f"no such key: {args[0]}"
    if kind is ZeroDivisionError:
        return "division by zero"
    if kind is TypeError:
        return "no such overload"
    if kind is NameError and args:
        return f"undeclared reference to '{args[0]}' (in container '')"
    if kind is IndexError:
        return f"index out of bounds: {args[0]}" if args else "index out of bounds"
    if kind is ValueError and args:
        return str(args[0])
    if isinstance(message, Exception):
        return _error_text(message)
    return str(message)


# ---- compiling and checking expressions


@dataclass(frozen=True)
class Parsed:
    text: str
    program: Program | None
    syntax_error: str
    ast: Any
    uses_old_self: bool


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Parsed:
    """Parse and transpile one expression (cached: a rule compiles once, whatever the number of CRD writes)."""
    eng = engine()
    with eng.lock:
        try:
            ast = eng.parser.parse(text)
        except eng.parse_error as exc:
            return Parsed(text, None, _syntax_issue(text, exc), None, False)
        try:
            runner = eng.env.program(ast, functions=LIBRARY)
        except Exception as exc:  # the transpiler refuses some shapes (a macro without a variable, `min()`...)
            message = f"expression not supported by kubesim's CEL (cel-python): {exc}"
            return Parsed(text, None, _issue(text, 1, 1, message), None, False)
    source = _HAS.sub(r"\1celpy.celtypes.BoolType(\2)", runner.tp.source_text)  # type: ignore[attr-defined]
    return Parsed(text, Program(source), "", ast, "oldSelf" in _free_identifiers(ast))


# celpy 0.5.0 transpiles has() to a Python bool, which its own !, && and || refuse: make it a CEL bool.
_HAS = re.compile(r"^(ex_\d+ = lambda activation: )(not isinstance\(celpy\.evaluation\.result\(activation, "
                  r"ex_\d+_h\), CELEvalError\))$", re.M)


def _syntax_issue(text: str, cause: Exception) -> str:
    """cel-go's syntax error line, from lark's exception."""
    token = getattr(cause, "token", None)
    line, column = getattr(cause, "line", 1), getattr(cause, "column", 1)
    if token is not None and token.type == "$END":
        lines = text.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
        return _issue(text, line, column, "Syntax error: mismatched input '<EOF>'")
    if token is not None:
        return _issue(text, line, column, f"Syntax error: mismatched input '{token.value}'")
    char = getattr(cause, "char", "")
    return _issue(text, max(line, 1), max(column, 1), f"Syntax error: token recognition error at: '{char}'")


def _issue(text: str, line: int, column: int, message: str) -> str:
    """One error as cel-go's Issues.String() shows it: location, message, the source line and a caret."""
    lines = text.splitlines() or [""]
    source = lines[min(line, len(lines)) - 1]
    return f"ERROR: <input>:{line}:{column}: {message}\n | {source}\n | {'.' * (column - 1)}^"


def rule_issues(parsed: Parsed, node_schema: Obj, resource: bool) -> str:
    """What cel-go's compiler would report for an expression on this schema node ("" if nothing)."""
    if parsed.syntax_error:
        return parsed.syntax_error
    checker = _Checker(parsed.text, _self_schema(node_schema, resource))
    checker.walk(parsed.ast, frozenset())
    return "\n".join(checker.issues)


_PASS_THROUGH = frozenset({"expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication",
                           "unary", "member", "primary", "paren_expr"})


class _Checker:
    """The checks of cel-go's type checker that matter for CRD authors: undeclared identifiers and functions,
    fields that the schema of `self` does not declare."""

    def __init__(self, text: str, self_schema: Obj) -> None:
        self.text = text
        self.self_schema = self_schema
        self.issues: list[str] = []

    def walk(self, tree: Any, bound: frozenset[str]) -> Obj | None:
        """Check `tree`; return the schema of its value when it is a field of `self` (None when unknown)."""
        kind = str(tree.data)
        children = tree.children
        if kind in _PASS_THROUGH and len(children) == 1 and hasattr(children[0], "data"):
            return self.walk(children[0], bound)
        if kind == "ident":
            return self._ident(children[0], bound)
        if kind == "member_dot":
            return self._select(self.walk(children[0], bound), children[1])
        if kind == "member_dot_arg":
            self._call(children, bound)
            return None
        if kind == "ident_arg":
            name = children[0]
            if name.value not in ("has", "dyn") and name.value not in engine().known_functions:
                self._report(name.line, name.column, f"undeclared reference to '{name.value}' (in container '')")
        for child in children:
            if hasattr(child, "data"):
                self.walk(child, bound)
        return None

    def _ident(self, token: Any, bound: frozenset[str]) -> Obj | None:
        name = token.value
        if name in ("self", "oldSelf") and name not in bound:
            return self.self_schema
        if name not in bound and name not in TYPE_NAMES:
            self._report(token.line, token.column, f"undeclared reference to '{name}' (in container '')")
        return None

    def _select(self, base: Obj | None, token: Any) -> Obj | None:
        if base is None:
            return None
        props = base.get("properties")
        if props:
            if token.value in props:
                return props[token.value] if isinstance(props[token.value], dict) else None
            self._report(token.line, max(token.column - 1, 1), f"undefined field '{token.value}'")
            return None
        extra = base.get("additionalProperties")
        return extra if isinstance(extra, dict) else None

    def _call(self, children: list[Any], bound: frozenset[str]) -> None:
        target, name = children[0], children[1]
        args = children[2].children if len(children) > 2 else []
        self.walk(target, bound)
        if name.value in MACROS and len(args) == 2:
            variable = _simple_identifier(args[0])
            self.walk(args[1], bound | {variable} if variable else bound)
            return
        if name.value not in engine().known_functions:
            self._report(name.line, max(name.column - 1, 1), f"undeclared reference to '{name.value}' "
                         "(in container '')")
        for arg in args:
            self.walk(arg, bound)

    def _report(self, line: int, column: int, message: str) -> None:
        self.issues.append(_issue(self.text, line, column, message))


def _simple_identifier(tree: Any) -> str:
    while hasattr(tree, "data") and len(tree.children) == 1:
        if str(tree.data) == "ident":
            return str(tree.children[0].value)
        tree = tree.children[0]
    return ""


def _free_identifiers(tree: Any, bound: frozenset[str] = frozenset()) -> set[str]:
    """Identifiers the expression reads from its activation (a macro variable shadows a name within its body)."""
    kind = str(tree.data)
    if kind == "ident":
        name = str(tree.children[0].value)
        return set() if name in bound else {name}
    if kind == "member_dot_arg" and len(tree.children) > 2 and tree.children[1].value in MACROS:
        args = tree.children[2].children
        if len(args) == 2:
            variable = _simple_identifier(args[0])
            return _free_identifiers(tree.children[0], bound) | _free_identifiers(args[1], bound | {variable})
    found: set[str] = set()
    for child in tree.children:
        if hasattr(child, "data"):
            found |= _free_identifiers(child, bound)
    return found


_FIELD_PATH_TOKEN = re.compile(r"'(?:\\.|[^'\\])*'|[.\[\]]|[^.\[\]]+")


def field_path(text: str, node_schema: Obj) -> str | None:
    """ValidFieldPath: a rule's fieldPath (`.a.b`, `['key']`) normalised as field.Path prints it, or None when
    it does not name a field of the schema."""
    if not text:
        return None
    tokens = _FIELD_PATH_TOKEN.findall(text)
    node, out, i = node_schema, "", 0
    while i < len(tokens):
        if tokens[i] == ".":
            if i + 1 >= len(tokens):
                return None
            name, i = tokens[i + 1], i + 2
        elif tokens[i] == "[":
            if i + 2 >= len(tokens) or tokens[i + 2] != "]" or not re.fullmatch(r"'.*'", tokens[i + 1], re.S):
                return None
            name, i = _unescape(tokens[i + 1][1:-1]), i + 3
            if name is None:
                return None
        else:
            return None
        props, extra = node.get("properties"), node.get("additionalProperties")
        if props:
            if not isinstance(props.get(name), dict):
                return None
            node, out = props[name], f"{out}.{name}" if out else name
        elif isinstance(extra, dict):
            node, out = extra, f"{out}[{name}]"
        else:
            return None
    return out or None


_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "'": "'", "\\": "\\"}


def _unescape(text: str) -> str | None:
    bad = [m for m in re.findall(r"\\(.)", text) if m not in _ESCAPES]
    return None if bad else re.sub(r"\\(.)", lambda m: _ESCAPES[m.group(1)], text)


# ---- the CRD itself: rules must compile before the CRD is accepted


def check_crd(crd: Obj, old: Obj | None = None) -> list[Cause]:
    """The x-kubernetes-validations errors of a CustomResourceDefinition (a ResourceType.validator).

    A schema shared by every version is reported under spec.validation, as the apiserver's internal version
    holds it; otherwise under spec.versions[i].schema."""
    spec: Obj = crd["spec"] if isinstance(crd.get("spec"), dict) else {}
    if old is not None and old.get("spec") == spec:
        return []  # a status or metadata update: the rules were checked when the spec was written
    versions = [v for v in spec.get("versions") or [] if isinstance(v, dict)]
    schemas = [((v.get("schema") or {}).get("openAPIV3Schema")) for v in versions]
    if not any(has_rules(s) for s in schemas):
        return []
    engine()
    if all(s == schemas[0] for s in schemas):
        targets = [("spec.validation.openAPIV3Schema", schemas[0])]
    else:
        targets = [(f"spec.versions[{i}].schema.openAPIV3Schema", s) for i, s in enumerate(schemas)]
    causes: list[Cause] = []
    for path, root in targets:
        if isinstance(root, dict):
            _check_schema(root, path, "", True, causes)
    return causes


def _check_schema(node: Obj, path: str, uncorrelatable: str, resource: bool, causes: list[Cause]) -> bool:
    """ValidateCustomResourceDefinitionOpenAPISchema, for the rules only: children first, then this node.
    Returns whether a rule was malformed here or below (the apiserver then compiles none of this node's)."""
    malformed = False
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        malformed |= _check_schema(extra, f"{path}.additionalProperties", uncorrelatable, _embedded(extra), causes)
    for name, sub in (node.get("properties") or {}).items():
        if isinstance(sub, dict):
            malformed |= _check_schema(sub, f"{path}.properties[{name}]", uncorrelatable, _embedded(sub), causes)
    items = node.get("items")
    if isinstance(items, dict):
        # Only the items of map-type lists correlate with old items; oldSelf means nothing below any other list.
        below = uncorrelatable or ("" if node.get("x-kubernetes-list-type") == "map" else path)
        malformed |= _check_schema(items, f"{path}.items", below, _embedded(items), causes)
    rules = [r for r in node.get(RULES) or [] if isinstance(r, dict)]
    if not rules:
        return malformed
    shape = _rule_shape_errors(rules, node, path, resource)
    causes.extend(shape)
    if not shape and not malformed:
        causes.extend(_rule_compile_errors(rules, node, path, uncorrelatable, resource))
    return malformed or bool(shape)


def _rule_shape_errors(rules: list[Obj], node: Obj, path: str, resource: bool) -> list[Cause]:
    out: list[Cause] = []
    for i, rule in enumerate(rules):
        at = f"{path}.{RULES}[{i}]"
        text, message = str(rule.get("rule") or ""), str(rule.get("message") or "")
        if not text.strip():
            out.append(_cause(f"{at}.rule", "Required value: rule is not specified", "FieldValueRequired"))
        elif message and not message.strip():
            out.append(_invalid(f"{at}.message", message, "message must be non-empty if specified"))
        elif _NEWLINE.search(message.strip()):
            out.append(_invalid(f"{at}.message", message, "message must not contain line breaks"))
        elif _NEWLINE.search(text.strip()) and not message.strip():
            out.append(_cause(f"{at}.message", "Required value: message must be specified if rule contains line "
                              "breaks", "FieldValueRequired"))
        expression = str(rule.get("messageExpression") or "")
        if expression and not expression.strip():
            out.append(_cause(f"{at}.messageExpression", "Required value: messageExpression must be non-empty if "
                              "specified", "FieldValueRequired"))
        reason = rule.get("reason")
        if reason is not None and reason not in SUPPORTED_REASONS:
            supported = ", ".join(_quote(r) for r in SUPPORTED_REASONS)
            out.append(_cause(f"{at}.reason", f"Unsupported value: {_quote(str(reason))}: supported values: "
                              f"{supported}", "FieldValueNotSupported"))
        out.extend(_field_path_errors(str(rule.get("fieldPath") or ""), f"{at}.fieldPath", node, resource))
    return out


_NEWLINE = re.compile(r"[\n\r]+")


def _field_path_errors(text: str, at: str, node: Obj, resource: bool) -> list[Cause]:
    out = []
    if text and not text.strip():
        out.append(_invalid(at, text, "fieldPath must be non-empty if specified"))
    if _NEWLINE.search(text):
        out.append(_invalid(at, text, "fieldPath must not contain line breaks"))
    if text and field_path(text, _self_schema(node, resource)) is None:
        out.append(_invalid(at, text, "fieldPath must be a valid path"))
    return out


def _rule_compile_errors(rules: list[Obj], node: Obj, path: str, uncorrelatable: str,
                         resource: bool) -> list[Cause]:
    out: list[Cause] = []
    for i, rule in enumerate(rules):
        at = f"{path}.{RULES}[{i}]"
        parsed = parse(str(rule["rule"]))
        issues = rule_issues(parsed, node, resource)
        if issues:
            out.append(_cause(f"{at}.rule", f"Invalid value: {_go_rule(rule)}: compilation failed: {issues}",
                              "FieldValueInvalid"))
        elif str(rule.get("messageExpression") or "").strip():
            message_issues = rule_issues(parse(str(rule["messageExpression"])), node, resource)
            if message_issues:
                out.append(_cause(f"{at}.messageExpression", f"Invalid value: {_go_rule(rule)}: messageExpression "
                                  f"compilation failed: {message_issues}", "FieldValueInvalid"))
        if not issues and parsed.uses_old_self:
            if uncorrelatable:
                out.append(_invalid(f"{at}.rule", str(rule["rule"]), "oldSelf cannot be used on the uncorrelatable "
                                    f"portion of the schema within {uncorrelatable}"))
        elif rule.get("optionalOldSelf") is not None:
            shown = str(rule["optionalOldSelf"]).lower()
            out.append(_cause(f"{at}.optionalOldSelf", f"Invalid value: {shown}: may not be set if oldSelf is not "
                              "used in rule", "FieldValueInvalid"))
    return out


def _go_rule(rule: Obj) -> str:
    """The %#v of apiextensions.ValidationRule, as field.Invalid shows it (pointers print as addresses)."""
    reason = "(*apiextensions.FieldValueErrorReason)(nil)" if rule.get("reason") is None else \
        "(*apiextensions.FieldValueErrorReason)(0xc000a1c0e0)"
    optional = "(*bool)(nil)" if rule.get("optionalOldSelf") is None else "(*bool)(0xc000a1c0f8)"
    return (f"apiextensions.ValidationRule{{Rule:{_quote(str(rule.get('rule') or ''))}, "
            f"Message:{_quote(str(rule.get('message') or ''))}, "
            f"MessageExpression:{_quote(str(rule.get('messageExpression') or ''))}, Reason:{reason}, "
            f"FieldPath:{_quote(str(rule.get('fieldPath') or ''))}, OptionalOldSelf:{optional}}}")


def _quote(text: str) -> str:
    """Go's %q, near enough: a double-quoted string with escapes."""
    return json.dumps(text, ensure_ascii=False)


# ---- functions of the Kubernetes CEL libraries that celpy lacks (strings, lists, regex, optional)
# The transpiled code calls them by module and name, so they are plain module-level functions.


def _char_at(text: str, index: int) -> Any:
    if not 0 <= index <= len(text):
        raise IndexError(index)
    return engine().types.String(text[index:index + 1])


def _index_of(target: Any, item: Any, start: int = 0) -> Any:
    if isinstance(target, str):
        return engine().types.Int(target.find(item, start))
    return engine().types.Int(next((i for i, x in enumerate(target) if x == item), -1))


def _last_index_of(target: Any, item: Any) -> Any:
    if isinstance(target, str):
        return engine().types.Int(target.rfind(item))
    return engine().types.Int(next((i for i in range(len(target) - 1, -1, -1) if target[i] == item), -1))


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _lower_ascii(text: str) -> Any:
    return engine().types.String(text.translate(_ASCII_LOWER))


def _upper_ascii(text: str) -> Any:
    return engine().types.String(text.translate(_ASCII_UPPER))


def _replace(text: str, old: str, new: str, count: int = -1) -> Any:
    return engine().types.String(text.replace(old, new, count))


def _split(text: str, separator: str, count: int = -1) -> Any:
    types = engine().types
    if count == 0:
        return types.List([])
    parts = text.split(separator, count - 1 if count > 0 else -1) if separator else list(text)
    return types.List([types.String(p) for p in parts])


def _substring(text: str, start: int, end: int | None = None) -> Any:
    end = len(text) if end is None else end
    if not 0 <= start <= end <= len(text):
        raise IndexError(f"substring({start}, {end})")
    return engine().types.String(text[start:end])


def _trim(text: str) -> Any:
    return engine().types.String(text.strip())


def _join(items: Iterable[str], separator: str = "") -> Any:
    return engine().types.String(separator.join(items))


def _is_sorted(items: list[Any]) -> Any:
    return engine().types.Bool(all(a <= b for a, b in itertools.pairwise(items)))


def _sum(items: list[Any]) -> Any:
    if not items:
        return engine().types.Int(0)
    return functools.reduce(operator.add, items)


def _max(items: list[Any]) -> Any:
    if not items:
        raise ValueError("max of an empty list")
    return functools.reduce(lambda a, b: b if b > a else a, items)


def _find(text: str, pattern: str) -> Any:
    found = re.search(pattern, text)
    return engine().types.String(found.group(0) if found else "")


def _find_all(text: str, pattern: str, limit: int = -1) -> Any:
    types = engine().types
    found = [types.String(m.group(0)) for m in re.finditer(pattern, text)]
    return types.List(found if limit < 0 else found[:limit])


def _has_value(optional: OptionalValue) -> Any:
    return engine().types.Bool(optional.present)


def _value(optional: OptionalValue) -> Any:
    if not optional.present:
        raise ValueError("optional.none() dereference")
    return optional.value


def _or_value(optional: OptionalValue, default: Any) -> Any:
    return optional.value if optional.present else default


LIBRARY: dict[str, Callable[..., Any]] = {
    "charAt": _char_at, "indexOf": _index_of, "lastIndexOf": _last_index_of, "lowerAscii": _lower_ascii,
    "upperAscii": _upper_ascii, "replace": _replace, "split": _split, "substring": _substring, "trim": _trim,
    "join": _join, "isSorted": _is_sorted, "sum": _sum, "max": _max, "find": _find, "findAll": _find_all,
    "hasValue": _has_value, "value": _value, "orValue": _or_value,
}
