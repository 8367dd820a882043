"""Request bodies the service accepts, as pydantic models, and the translation of their validation errors into
Base registry messages (PropertyUnknown, PropertyValueTypeError, ActionParameterMissing, ...)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import errors
from .errors import RedfishError, combine

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class BootPatch(_Body):
    # Targets are checked against the machine's list at request time, so the allowed set is not fixed here.
    BootSourceOverrideTarget: str | None = None
    BootSourceOverrideEnabled: Literal["Once", "Continuous", "Disabled"] | None = None
    BootSourceOverrideMode: Literal["UEFI", "Legacy"] | None = None
    HttpBootUri: str | None = None  # null clears it (sushy sends null when it leaves UefiHttp): see model_fields_set


class IndicatorPatch(_Body):
    """Identify: LocationIndicatorActive, or the deprecated IndicatorLED older clients write (Lit and Blinking both
    light it)."""

    LocationIndicatorActive: bool | None = None
    IndicatorLED: Literal["Lit", "Blinking", "Off"] | None = None


class SystemPatch(IndicatorPatch):
    Boot: BootPatch | None = None


class ChassisPatch(IndicatorPatch):
    pass


class SecureBootPatch(_Body):
    SecureBootEnable: bool | None = None


class ResetAction(_Body):
    ResetType: str


class ClearLogAction(_Body):
    LogEntriesETag: str | None = None


class InsertMediaAction(_Body):
    Image: str
    Inserted: bool = True
    WriteProtected: bool = True
    # Empty values are accepted (sushy sends them on a retry); any other is refused with ActionParameterNotSupported
    # (vbmc/redfish/app.py, insert_media), never dropped. CDI's importer always streams.
    UserName: str | None = None
    Password: str | None = None
    TransferMethod: Literal["Stream", "Upload"] | None = None
    TransferProtocolType: Literal["HTTP", "HTTPS"] | None = None


class EjectMediaAction(_Body):
    pass


class MediaPatch(_Body):
    Image: str | None = None
    Inserted: bool | None = None
    WriteProtected: bool | None = None


class SessionCreate(_Body):
    UserName: str
    Password: str
    Context: str | None = Field(default=None)


class SessionServicePatch(_Body):
    SessionTimeout: int | None = None  # bounds (DMTF's 30..86400) checked by the route, with their own message


class OdataLink(_Body):
    odata_id: str = Field(alias="@odata.id")


class VolumeLinks(_Body):
    Drives: list[OdataLink] | None = None


class VolumeCreate(_Body):
    """What Ironic's `redfish` RAID interface posts (raid.py, _construct_volume_payload): RAIDType and CapacityBytes,
    the Drives it chose, a Name (and the apply time the collection advertises: an annotation, `apply_time`)."""

    CapacityBytes: int = Field(gt=0)
    RAIDType: str | None = None  # checked against the controller's SupportedRAIDTypes (systems.py)
    Name: str | None = None
    Links: VolumeLinks | None = None


class VolumeDelete(_Body):
    pass


class SubscriptionCreate(_Body):
    Destination: str
    Protocol: Literal["Redfish"]
    Context: str = ""
    RegistryPrefixes: list[str] | None = None
    ResourceTypes: list[str] | None = None
    OriginResources: list[OdataLink] | None = None
    HttpHeaders: list[dict[str, str]] | None = None
    VerifyCertificate: bool = True
    SubscriptionType: Literal["RedfishEvent"] | None = None
    EventFormatType: Literal["Event"] | None = None
    DeliveryRetryPolicy: Literal["SuspendRetries", "TerminateAfterRetries", "RetryForever",
                                 "RetryForeverWithBackoff"] | None = None


class SubscriptionPatch(_Body):
    Context: str | None = None


class EventServicePatch(_Body):
    DeliveryRetryAttempts: int | None = None
    DeliveryRetryIntervalSeconds: int | None = None


class SubmitTestEventAction(_Body):
    MessageId: str
    Message: str | None = None
    MessageArgs: list[str] | None = None
    MessageSeverity: Literal["OK", "Warning", "Critical"] | None = None
    Severity: str | None = None  # deprecated: MessageSeverity
    OriginOfCondition: str | None = None
    EventId: str | None = None
    EventTimestamp: str | None = None
    EventGroupId: int | None = None


# No request body this service accepts nests deeper than 4 levels; 32 leaves room for Oem blocks and keeps the
# parser (recursive in CPython) and the error rendering far from the interpreter's recursion limit.
MAX_DEPTH = 32
SECRET_PROPERTIES = frozenset(("Password",))  # never echoed in an error
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"?')
_BRACKETS = re.compile(rb"[\[\]{}]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def load_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is an empty object (as for EjectMedia).

    Refused with 400: what is not JSON, not UTF-8 or not an object (MalformedJSON), nesting deeper than
    MAX_DEPTH (MalformedJSON, checked before parsing), numbers a float cannot hold and NaN/Infinity (not JSON,
    RFC 8259 6), keys that are not valid Unicode (MalformedJSON) and string values that are not
    (PropertyValueFormatError naming the property: a lone UTF-16 surrogate such as \\ud800 escapes JSON's
    grammar but no text can hold it)."""
    if not raw.strip():
        return {}
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise RedfishError(400, "MalformedJSON", detail=f"The body is nested deeper than {MAX_DEPTH} levels.")
    try:
        # Decoded here: json.loads would also take UTF-16 and UTF-32; Redfish bodies are UTF-8 (a BOM is ignored).
        doc = json.loads(raw.decode("utf-8-sig"), parse_constant=_no_constant, parse_float=_finite_float,
                         parse_int=_bounded_int)
    except (ValueError, RecursionError):
        raise RedfishError(400, "MalformedJSON") from None
    if not isinstance(doc, dict):
        raise RedfishError(400, "MalformedJSON", detail="The body must be a JSON object.")
    _check_text(doc, [])
    return doc


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in `raw`, brackets inside strings not counted, up to `limit + 1` (the
    scan stops there); linear, and works on any bytes (it does not need valid JSON)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b"", raw)):
        if match[0] in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 40:  # far beyond any property's range; also spares int() its quadratic cost
        raise ValueError("integer out of range")
    return int(text)


def _check_text(value: Any, loc: list[str]) -> None:
    if isinstance(value, str):
        if _SURROGATE.search(value):
            name = loc[-1] if loc else ""
            secret = any(part in SECRET_PROPERTIES for part in loc)
            shown = "(redacted)" if secret else _SURROGATE.sub("\ufffd", value)
            raise RedfishError(400, "PropertyValueFormatError", shown, name, related="#/" + "/".join(loc),
                               detail="The value is not valid Unicode text.")
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                raise RedfishError(400, "MalformedJSON", detail="A property name is not valid Unicode text.")
            _check_text(item, [*loc, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, [*loc, str(index)])


APPLY_TIME = "@Redfish.OperationApplyTime"


def apply_time(doc: dict[str, Any], supported: tuple[str, ...]) -> str | None:
    """The request's @Redfish.OperationApplyTime, refused (PropertyValueNotInList) when not one the resource
    advertises in @Redfish.OperationApplyTimeSupport."""
    value = doc.get(APPLY_TIME)
    if value is not None and value not in supported:
        raise RedfishError(400, "PropertyValueNotInList", value, APPLY_TIME, related=f"#/{APPLY_TIME}",
                           detail=f"Supported: {', '.join(supported)}.")
    return value if isinstance(value, str) else None


def parse_patch(model: type[M], doc: dict[str, Any], readonly: dict[str, Any]) -> M:
    """Validate a PATCH body; properties the resource shows but does not let a client write are
    PropertyNotWritable, others PropertyUnknown."""
    doc = {k: v for k, v in doc.items() if not k.startswith("@")}  # @odata.* annotations are not properties
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err["loc"]]
            name, pointer = loc[-1] if loc else "", "#/" + "/".join(loc)
            value = _shown(loc, _value_at(doc, loc))
            if err["type"] == "extra_forbidden":
                if len(loc) == 1 and name in readonly:
                    errors.append(RedfishError(400, "PropertyNotWritable", name, related=pointer))
                else:
                    errors.append(RedfishError(400, "PropertyUnknown", name, related=pointer))
            elif err["type"] == "literal_error" and isinstance(value, str):
                errors.append(RedfishError(400, "PropertyValueNotInList", value, name, related=pointer))
            elif err["type"] == "missing":
                errors.append(RedfishError(400, "PropertyMissing", name, related=pointer))
            else:
                errors.append(RedfishError(400, "PropertyValueTypeError", value, name, related=pointer))
        raise combine(errors) from None


def parse_partial_patch(model: type[M], doc: dict[str, Any],
                        readonly: dict[str, Any]) -> tuple[M, list[dict[str, Any]]]:
    """A PATCH that mixes properties the client may write with ones it may not (DSP0266 "Modification success
    responses": the service applies what it can and answers 200 with a message per property it did not apply):
    the writable part, validated, and the PropertyNotWritable / PropertyUnknown messages for the rest. A body with
    nothing writable in it is refused whole (400), as is one whose writable values are wrong."""
    doc = {k: v for k, v in doc.items() if not k.startswith("@")}
    known = {f.alias or name for name, f in model.model_fields.items()}
    refused = [k for k in doc if k not in known]
    if refused and len(refused) == len(doc):
        return parse_patch(model, doc, readonly), []  # raises: nothing here can be applied
    messages = [errors.message("PropertyNotWritable" if k in readonly else "PropertyUnknown", k, related=f"#/{k}")
                for k in refused]
    return parse_patch(model, {k: v for k, v in doc.items() if k in known}, readonly), messages


def parse_action(model: type[M], doc: dict[str, Any], action: str) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err["loc"]]
            name, pointer = (loc[0] if loc else ""), "#/" + "/".join(loc)
            value = _shown(loc, _value_at(doc, loc))
            if err["type"] == "extra_forbidden":
                errors.append(RedfishError(400, "ActionParameterUnknown", action, name, related=pointer))
            elif err["type"] == "missing":
                errors.append(RedfishError(400, "ActionParameterMissing", action, name, related=pointer))
            elif err["type"] == "literal_error" and isinstance(value, str):
                errors.append(RedfishError(400, "ActionParameterValueNotInList", value, name, action,
                                           related=pointer))
            else:
                errors.append(RedfishError(400, "ActionParameterValueTypeError", value, name, action,
                                           related=pointer))
        raise combine(errors) from None


def _shown(loc: list[str], value: Any) -> Any:
    """A value as an error message may echo it: a secret's never is."""
    return "(redacted)" if value is not None and any(p in SECRET_PROPERTIES for p in loc) else value


def _value_at(doc: Any, loc: list[str]) -> Any:
    for part in loc:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc
