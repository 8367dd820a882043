"""API errors rendered as Kubernetes `Status` objects, with the codes and reasons kube-apiserver uses."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the API answers with: an HTTP code and a metav1.Status body."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(resource: str, name: str, group: str = "") -> dict[str, Any]:
    details: dict[str, Any] = {"kind": resource}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    return details


def _qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        404, "NotFound", f'{_qualified(resource, group)} "{name}" not found',
        details=_details(resource, name, group),
    )


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{_qualified(resource, group)} "{name}" already exists',
        details=_details(resource, name, group),
    )


def conflict(resource: str, name: str, group: str = "", why: str = "") -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {_qualified(resource, group)} "{name}": {why}',
        details=_details(resource, name, group),
    )


def invalid(kind: str, name: str, causes: list[dict[str, str]], group: str = "") -> ApiError:
    """422 Invalid; each cause has `field` and `message` (and a reason such as FieldValueInvalid)."""
    text = ", ".join(f"{c['field']}: {c['message']}" if c.get("field") else c["message"] for c in causes)
    details = _details(kind, name, group)
    details["causes"] = [
        {"reason": c.get("reason", "FieldValueInvalid"), "message": c["message"], "field": c.get("field", "")}
        for c in causes
    ]
    return ApiError(422, "Invalid", f'{kind}{"." + group if group else ""} "{name}" is invalid: [{text}]'
                    if len(causes) > 1 else f'{kind}{"." + group if group else ""} "{name}" is invalid: {text}',
                    details=details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def forbidden(message: str) -> ApiError:
    return ApiError(403, "Forbidden", message)


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType",
                    f'the body of the request was in an unknown format - accepted media types include: '
                    f'application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, '
                    f'application/strategic-merge-patch+json (got "{content_type}")')


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", message)


def unprocessable(message: str, kind: str = "", name: str = "") -> ApiError:
    return ApiError(422, "Invalid", message, details=_details(kind, name) if kind else None)
