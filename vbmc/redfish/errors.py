"""Redfish errors: one exception type carrying an HTTP status and Base registry messages, rendered as the
`{"error": {..., "@Message.ExtendedInfo": [...]}}` body the Redfish specification defines (DSP0266, 9.6)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Base message registry 1.19 (DSP8011); MessageIds are "Base.<major>.<minor>.<key>".
REGISTRY = "Base.1.19"
MESSAGE_ODATA_TYPE = "#Message.v1_2_1.Message"

# key: (message template with %1..%n, severity, resolution)
MESSAGES: Mapping[str, tuple[str, str, str]] = {
    "GeneralError": (
        "A general error has occurred.  See Resolution for information on how to resolve the error, or "
        "@Message.ExtendedInfo if Resolution is not provided.", "Critical", "None."),
    "MalformedJSON": (
        "The request body submitted was malformed JSON and could not be parsed by the receiving service.",
        "Critical", "Ensure that the request body is valid JSON and resubmit the request."),
    "PropertyValueNotInList": (
        "The value '%1' for the property %2 is not in the list of acceptable values.", "Warning",
        "Choose a value from the enumeration list that the implementation can support and resubmit the request "
        "if the operation failed."),
    "PropertyValueTypeError": (
        "The value '%1' for the property %2 is not a type that the property can accept.", "Warning",
        "Correct the value for the property in the request body and resubmit the request if the operation "
        "failed."),
    "PropertyValueFormatError": (
        "The value '%1' for the property %2 is not a format that the property can accept.", "Warning",
        "Correct the value for the property in the request body and resubmit the request if the operation "
        "failed."),
    "PropertyValueOutOfRange": (
        "The value '%1' for the property %2 is not in the supported range of acceptable values.", "Warning",
        "Correct the value for the property in the request body and resubmit the request if the operation "
        "failed."),
    "PropertyUnknown": (
        "The property %1 is not in the list of valid properties for the resource.", "Warning",
        "Remove the unknown property from the request body and resubmit the request if the operation failed."),
    "PropertyNotWritable": (
        "The property %1 is a read-only property and cannot be assigned a value.", "Warning",
        "Remove the property from the request body and resubmit the request if the operation failed."),
    "PropertyMissing": (
        "The property %1 is a required property and must be included in the request.", "Warning",
        "Ensure that the property is in the request body and has a valid value and resubmit the request if the "
        "operation failed."),
    "ActionParameterMissing": (
        "The action %1 requires the parameter %2 to be present in the request body.", "Critical",
        "Supply the action with the required parameter in the request body when the request is resubmitted."),
    "ActionParameterNotSupported": (
        "The parameter %1 for the action %2 is not supported on the target resource.", "Warning",
        "Remove the parameter supplied and resubmit the request if the operation failed."),
    "ActionParameterUnknown": (
        "The action %1 was submitted with the invalid parameter %2.", "Warning",
        "Correct the invalid parameter and resubmit the request if the operation failed."),
    "ActionParameterValueNotInList": (
        "The value '%1' for the parameter %2 in the action %3 is not in the list of acceptable values.",
        "Warning",
        "Choose a value from the enumeration list that the implementation can support and resubmit the request "
        "if the operation failed."),
    "ActionParameterValueTypeError": (
        "The value '%1' for the parameter %2 in the action %3 is not a type that the parameter can accept.",
        "Warning",
        "Correct the value for the parameter in the request body and resubmit the request if the operation "
        "failed."),
    "ActionParameterValueFormatError": (
        "The value '%1' for the parameter %2 in the action %3 is not a format that the parameter can accept.",
        "Warning",
        "Correct the value for the parameter in the request body and resubmit the request if the operation "
        "failed."),
    "ActionNotSupported": (
        "The action %1 is not supported by the resource.", "Critical",
        "Check the Actions property in the resource for the supported actions."),
    "ResourceNotFound": (
        "The requested resource of type %1 named '%2' was not found.", "Critical",
        "Provide a valid resource identifier and resubmit the request."),
    "ResourceMissingAtURI": (
        "The resource at the URI '%1' was not found.", "Critical",
        "Place a valid resource at the URI or correct the URI and resubmit the request."),
    "InsufficientPrivilege": (
        "There are insufficient privileges for the account or credentials associated with the current session "
        "to perform the requested operation.", "Critical",
        "Either abandon the operation or change the associated access rights and resubmit the request if the "
        "operation failed."),
    "NoValidSession": (
        "There is no valid session established with the implementation.", "Critical",
        "Establish a session before attempting any operations."),
    "PreconditionFailed": (
        "The ETag supplied did not match the ETag required to change this resource.", "Critical",
        "Try the operation again using the appropriate ETag."),
    "HeaderInvalid": (
        "Header '%1' is invalid.", "Critical", "Resubmit the request with a valid request header."),
    "QueryParameterUnsupported": (
        "Query parameter '%1' is not supported.", "Warning",
        "Remove the query parameter and resubmit the request if the operation failed."),
    "PropertyValueConflict": (
        "The property '%1' could not be written because its value would conflict with the value of the '%2' "
        "property.", "Warning", "No resolution is required."),
    "PropertyValueResourceConflict": (
        "The property '%1' with the requested value of '%2' could not be written because the value conflicts with "
        "the state or configuration of the resource at '%3'.", "Warning", "None."),
    "ResourceInUse": (
        "The change to the requested resource failed because the resource is in use or in transition.",
        "Warning", "Remove the condition and resubmit the request if the operation failed."),
    "OperationNotAllowed": (
        "The HTTP method is not allowed on this URI.", "Critical", "None."),
    "ServiceTemporarilyUnavailable": (
        "The service is temporarily unavailable.  Retry in %1 seconds.", "Critical",
        "Wait for the indicated retry duration and retry the operation."),
    "ServiceDisabled": (
        "The operation failed because the service at %1 is disabled and cannot accept requests.", "Warning",
        "Enable the service and resubmit the request if the operation failed."),
    "QueryParameterValueFormatError": (
        "The value '%1' for the parameter %2 is of a different format than the parameter can accept.",
        "Warning", "Correct the value for the query parameter in the request and resubmit the request if the operation "
        "failed."),
    "CreateLimitReachedForResource": (
        "The create operation failed because the resource has reached the limit of possible resources.",
        "Critical", "Either delete resources and resubmit the request if the operation failed or do not resubmit "
        "the request."),
    "ResourceCannotBeDeleted": (
        "The delete request failed because the resource requested cannot be deleted.", "Critical",
        "Do not attempt to delete a non-deletable resource."),
    "ActionParameterValueError": (
        "The value for the parameter %1 in the action %2 is invalid.", "Warning",
        "Correct the value for the parameter in the request body and resubmit the request if the operation "
        "failed."),
    "PropertyValueError": (
        "The value provided for the property %1 is not valid.", "Warning",
        "Correct the value for the property in the request body and resubmit the request if the operation "
        "failed."),
    "Created": ("The resource was created successfully.", "OK", "None."),
    "Success": ("The request completed successfully.", "OK", "None."),
}


def message(key: str, *args: object, related: str = "") -> dict[str, Any]:
    """One `@Message.ExtendedInfo` entry with %1..%n filled in; `related` is a JSON pointer into the request."""
    template, severity, resolution = MESSAGES[key]
    text = template
    strings = [_arg(a) for a in args]
    for i, arg in reversed(list(enumerate(strings, start=1))):  # %10 before %1, should it ever exist
        text = text.replace(f"%{i}", arg)
    info: dict[str, Any] = {"@odata.type": MESSAGE_ODATA_TYPE, "MessageId": f"{REGISTRY}.{key}", "Message": text,
                            "MessageArgs": strings, "MessageSeverity": severity, "Resolution": resolution}
    if related:
        info["RelatedProperties"] = [related]
    return info


def _arg(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


class RedfishError(Exception):
    """An error answer: HTTP status, Base registry messages, optional headers (Allow, Retry-After, ...)."""

    def __init__(self, status: int, key: str, *args: object, detail: str = "", related: str = "",
                 headers: Mapping[str, str] | None = None, extra: list[dict[str, Any]] | None = None) -> None:
        self.status = status
        self.infos = [message(key, *args, related=related), *(extra or [])]
        self.detail = detail
        self.headers = dict(headers or {})
        super().__init__(detail or self.infos[0]["Message"])

    def body(self) -> dict[str, Any]:
        first = self.infos[0]
        if len(self.infos) > 1:
            code, text = f"{REGISTRY}.GeneralError", "Multiple errors occurred. See @Message.ExtendedInfo."
        else:
            code, text = first["MessageId"], first["Message"]
        if self.detail:
            text = f"{text} {self.detail}"
        return {"error": {"code": code, "message": text, "@Message.ExtendedInfo": self.infos}}


def not_found(path: str) -> RedfishError:
    return RedfishError(404, "ResourceMissingAtURI", path)


def combine(errors: list[RedfishError]) -> RedfishError:
    """Several problems in one request are reported together, as the specification asks."""
    first, *rest = errors
    first.infos.extend(info for e in rest for info in e.infos)
    return first
