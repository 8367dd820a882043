"""Request bodies the service accepts, as pydantic models, and the translation of their validation errors into
Base registry messages (PropertyUnknown, PropertyValueTypeError, ActionParameterMissing, ...)."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RedfishError, combine

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class BootPatch(_Body):
    # Targets are checked against the machine's list at request time, so the allowed set is not fixed here.
    BootSourceOverrideTarget: str | None = None
    BootSourceOverrideEnabled: Literal["Once", "Continuous", "Disabled"] | None = None
    BootSourceOverrideMode: Literal["UEFI", "Legacy"] | None = None


class SystemPatch(_Body):
    Boot: BootPatch | None = None


class ResetAction(_Body):
    ResetType: str


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


def load_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is an empty object (as for EjectMedia)."""
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        raise RedfishError(400, "MalformedJSON") from None
    if not isinstance(doc, dict):
        raise RedfishError(400, "MalformedJSON", detail="The body must be a JSON object.")
    return doc


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
            value = _value_at(doc, loc)
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


def parse_action(model: type[M], doc: dict[str, Any], action: str) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err["loc"]]
            name, pointer = (loc[0] if loc else ""), "#/" + "/".join(loc)
            value = _value_at(doc, loc)
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


def _value_at(doc: Any, loc: list[str]) -> Any:
    for part in loc:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc
