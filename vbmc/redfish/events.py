"""The EventService: subscriptions (EventDestination: POST, GET, PATCH of Context, DELETE), SubmitTestEvent, and
the SSE stream at ServerSentEventUri. Delivery and the subscriptions' store are vbmc/redfish/eventservice.py's."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, request

from . import eventservice, payloads, resources
from .errors import RedfishError, not_found
from .eventservice import SSE_ENVIRON, EventService, StoreUnavailable, Subscription, TooMany
from .resources import EVENT_SERVICE, SSE_URI, SUBMIT_TEST_EVENT, SUBSCRIPTIONS
from .service import Rendered, Service, etag_of

MAX_DESTINATION = 2048
MAX_CONTEXT = 256
MAX_HEADERS = 16
MAX_HEADER_BYTES = 4096
# Headers the service writes itself: a subscription cannot replace them.
RESERVED_HEADERS = frozenset(("content-type", "content-length", "host", "transfer-encoding", "connection"))
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_FILTER_TERM = re.compile(r"^(RegistryPrefix|ResourceType|OriginResource) eq '([^']*)'$")
FILTER_PROPERTIES = {"RegistryPrefix": 0, "ResourceType": 1, "OriginResource": 2}


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("events", __name__)
    route, ids = svc.route, svc.ids
    events = svc.events
    if events is None:
        raise ValueError("the events blueprint needs the Service's EventService")
    media_base = f"{ids.manager}/VirtualMedia"

    def origins_allowed() -> set[str]:
        return {ids.system, ids.manager, media_base, *(f"{media_base}/{s}" for s in svc.machine.media_slots())}

    @route(bp, EVENT_SERVICE, ("GET", "PATCH"))
    def event_service() -> Response:
        if request.method == "PATCH":
            current = svc.cache.get("event_service", "EventService", _settings(events), lambda: _render(events))
            svc.check_if_match(current)
            patch, refused = payloads.parse_partial_patch(payloads.EventServicePatch, svc.body(), _render(events))
            attempts = patch.DeliveryRetryAttempts
            if attempts is not None and not 0 <= attempts <= 10:
                raise RedfishError(400, "PropertyValueNotInList", attempts, "DeliveryRetryAttempts",
                                   related="#/DeliveryRetryAttempts", detail="It must be between 0 and 10.")
            if patch.DeliveryRetryIntervalSeconds is not None:
                if not 1 <= patch.DeliveryRetryIntervalSeconds <= 3600:
                    raise RedfishError(400, "PropertyValueNotInList", patch.DeliveryRetryIntervalSeconds,
                                       "DeliveryRetryIntervalSeconds", related="#/DeliveryRetryIntervalSeconds",
                                       detail="It must be between 1 and 3600.")
                events.retry_interval = patch.DeliveryRetryIntervalSeconds
            if patch.DeliveryRetryAttempts is not None:
                events.retry_attempts = patch.DeliveryRetryAttempts
            rendered = svc.cache.get("event_service", "EventService", _settings(events), lambda: _render(events))
            return svc.send(rendered, etag=True, messages=refused)
        rendered = svc.cache.get("event_service", "EventService", _settings(events), lambda: _render(events))
        return svc.send(rendered, etag=True)

    def subscribe() -> Response:
        sub = events_call(events.create, parse_subscription(svc.body(), origins_allowed()))
        return svc.send_doc("EventDestination", resources.event_destination(sub), 201,
                            headers={"Location": f"{SUBSCRIPTIONS}/{sub.id}"})

    @route(bp, f"{SUBSCRIPTIONS}/Members", ("POST",))
    def subscription_members() -> Response:
        return subscribe()  # DSP0266 "POST (create)": a POST to a collection's Members is a POST to the collection

    @route(bp, SUBSCRIPTIONS, ("GET", "POST"))
    def subscriptions() -> Response:
        if request.method == "POST":
            return subscribe()
        members = [f"{SUBSCRIPTIONS}/{s.id}" for s in events_call(events.subscriptions)]
        return svc.send_doc("EventDestinationCollection", resources.collection(
            "EventDestinationCollection", SUBSCRIPTIONS, "Event Subscriptions", members))

    @route(bp, f"{SUBSCRIPTIONS}/<sub_id>", ("GET", "PATCH", "DELETE"))
    def subscription(sub_id: str) -> Response:
        sub = events_call(events.get, sub_id)
        if sub is None:
            raise not_found(request.path)
        if request.method == "DELETE":
            events_call(events.delete, sub_id)
            return svc.no_content()
        if request.method == "PATCH":
            shown = resources.event_destination(sub)
            body = json.dumps(shown, separators=(",", ":")).encode()
            svc.check_if_match(Rendered(body, etag_of(body), "EventDestination"))
            patch, refused = payloads.parse_partial_patch(payloads.SubscriptionPatch, svc.body(), shown)
            if patch.Context is not None:
                check_context(patch.Context)
                sub = events_call(events.update, sub_id, patch.Context)
                if sub is None:
                    raise not_found(request.path)
            return svc.send_doc("EventDestination", resources.event_destination(sub), etag=True, messages=refused)
        return svc.send_doc("EventDestination", resources.event_destination(sub), etag=True)

    @route(bp, SUBMIT_TEST_EVENT, ("POST",))
    def submit_test_event() -> Response:
        action = "EventService.SubmitTestEvent"
        parsed = payloads.parse_action(payloads.SubmitTestEventAction, svc.body(), action)
        origin = parsed.OriginOfCondition or ""
        if origin and origin not in origins_allowed():
            raise RedfishError(400, "ActionParameterValueNotInList", origin, "OriginOfCondition", action,
                               related="#/OriginOfCondition")
        severity = parsed.MessageSeverity or parsed.Severity or "OK"
        if severity not in ("OK", "Warning", "Critical"):
            raise RedfishError(400, "ActionParameterValueNotInList", severity, "Severity", action,
                               related="#/Severity")
        stamp = parsed.EventTimestamp or ""
        if stamp:
            try:
                datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            except ValueError:
                raise RedfishError(400, "ActionParameterValueFormatError", stamp, "EventTimestamp", action,
                                   related="#/EventTimestamp",
                                   detail="An ISO 8601 date and time is expected.") from None
        record = events.test_record(parsed.MessageId, parsed.Message or "Test event.", parsed.MessageArgs or [],
                                    severity, origin, parsed.EventId or "", stamp, parsed.EventGroupId)
        events.submit_test(record)
        return svc.no_content()

    @route(bp, SSE_URI)
    def sse() -> Response:
        prefixes, types, origins = parse_filter(request.args.get("$filter"))
        unknown = [k for k in request.args if k != "$filter"]
        if unknown:
            raise RedfishError(400, "QueryParameterValueFormatError", request.args[unknown[0]], unknown[0])
        last = request.headers.get("Last-Event-ID")
        last_id: int | None = None
        if last is not None:
            last_id = int(last) if last.strip().isdigit() else 0  # an id not ours: everything the history holds
        stream = events.open_stream(prefixes, types, origins, last_id)
        if stream is None:
            raise RedfishError(503, "ServiceTemporarilyUnavailable", 5, headers={"Retry-After": "5"},
                               detail=f"{events.max_streams} event streams are open already.")
        request.environ[SSE_ENVIRON] = stream
        response = Response(iter(stream), status=200, content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.call_on_close(stream.close)
        return response

    return bp


def _settings(events: EventService) -> tuple[int, float]:
    return events.retry_attempts, events.retry_interval


def _render(events: EventService) -> dict[str, Any]:
    return resources.event_service(events.retry_attempts, int(events.retry_interval),
                                   eventservice.REGISTRY_PREFIXES, eventservice.RESOURCE_TYPES)


def events_call(function: Any, *args: Any) -> Any:
    """A call to the EventService: its failures as Redfish errors."""
    try:
        return function(*args)
    except StoreUnavailable as exc:
        raise RedfishError(503, "ServiceTemporarilyUnavailable", 5, detail=str(exc),
                           headers={"Retry-After": "5"}) from None
    except TooMany as exc:
        raise RedfishError(400, "CreateLimitReachedForResource", detail=str(exc)) from None
    except RedfishError:
        raise
    except Exception as exc:  # the store (the Kubernetes API) refused or did not answer
        raise RedfishError(503, "ServiceTemporarilyUnavailable", 5, headers={"Retry-After": "5"},
                           detail=f"The subscriptions could not be stored: {exc}") from None


def check_context(context: str) -> None:
    if len(context) > MAX_CONTEXT:
        raise RedfishError(400, "PropertyValueFormatError", context[:40] + "...", "Context", related="#/Context",
                           detail=f"Context is at most {MAX_CONTEXT} characters.")


def destination_problem(url: str) -> str | None:
    if len(url) > MAX_DESTINATION:
        return f"The destination URL is longer than {MAX_DESTINATION} characters."
    if any(c <= " " or c == "\x7f" for c in url):
        return "The destination URL contains a space or a control character."
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port
    except ValueError as exc:
        return f"The destination URL is malformed: {exc}."
    if parts.scheme not in ("http", "https"):
        return "The destination must be an http or https URL."
    if not host:
        return "The destination URL has no host."
    if parts.username or parts.password:
        return "Put credentials in HttpHeaders (an Authorization header), not in the destination URL."
    return None


def parse_subscription(doc: dict[str, Any], origins_allowed: set[str]) -> Subscription:
    if "EventTypes" in doc:
        raise RedfishError(400, "PropertyUnknown", "EventTypes", related="#/EventTypes",
                           detail="EventTypes is deprecated (Redfish 2019.1): filter with RegistryPrefixes, "
                                  "ResourceTypes or OriginResources.")
    parsed = payloads.parse_patch(payloads.SubscriptionCreate, doc, {})
    problem = destination_problem(parsed.Destination)
    if problem is not None:
        raise RedfishError(400, "PropertyValueFormatError", parsed.Destination, "Destination",
                           related="#/Destination", detail=problem)
    check_context(parsed.Context)
    for name, values, allowed in (("RegistryPrefixes", parsed.RegistryPrefixes, eventservice.REGISTRY_PREFIXES),
                                  ("ResourceTypes", parsed.ResourceTypes, eventservice.RESOURCE_TYPES)):
        for i, value in enumerate(values or []):
            if value not in allowed:
                raise RedfishError(400, "PropertyValueNotInList", value, name, related=f"#/{name}/{i}",
                                   detail=f"This service sends {', '.join(allowed)}.")
    origins = [o.odata_id.rstrip("/") for o in parsed.OriginResources or []]
    for i, origin in enumerate(origins):
        if origin not in origins_allowed:
            raise RedfishError(400, "PropertyValueNotInList", origin, "OriginResources",
                               related=f"#/OriginResources/{i}",
                               detail="Events originate from the System and its virtual media.")
    headers = parse_headers(parsed.HttpHeaders or [])
    return Subscription(id="", destination=parsed.Destination, context=parsed.Context,
                        registry_prefixes=list(parsed.RegistryPrefixes or []),
                        resource_types=list(parsed.ResourceTypes or []), origin_resources=origins,
                        headers=headers, verify_certificate=parsed.VerifyCertificate,
                        retry_policy=parsed.DeliveryRetryPolicy or "SuspendRetries")


def parse_headers(entries: list[dict[str, str]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for i, entry in enumerate(entries):
        for name, value in entry.items():
            pointer = f"#/HttpHeaders/{i}/{name}"
            if not _TOKEN.match(name) or name.lower() in RESERVED_HEADERS:
                raise RedfishError(400, "PropertyValueFormatError", name, "HttpHeaders", related=pointer,
                                   detail="A header name must be an HTTP token, and not one the service sets "
                                          "itself (Content-Type, Content-Length, Host, ...).")
            if any(c in value for c in "\r\n\0"):
                raise RedfishError(400, "PropertyValueFormatError", "(redacted)", "HttpHeaders", related=pointer,
                                   detail="A header value cannot contain CR, LF or NUL.")
            headers[name] = value
    if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers.items()) > MAX_HEADER_BYTES:
        raise RedfishError(400, "PropertyValueFormatError", "(redacted)", "HttpHeaders", related="#/HttpHeaders",
                           detail=f"At most {MAX_HEADERS} headers and {MAX_HEADER_BYTES} bytes.")
    return headers


def parse_filter(text: str | None) -> tuple[list[str], list[str], list[str]]:
    """`$filter` on the SSE URI (DSP0266 "Server-sent events"): `Property eq 'value'` terms over RegistryPrefix,
    ResourceType and OriginResource, `or` between values of one property, `and` between properties, parentheses
    allowed. The three lists of accepted values (empty: any)."""
    lists: tuple[list[str], list[str], list[str]] = ([], [], [])
    if text is None:
        return lists
    bad = RedfishError(400, "QueryParameterValueFormatError", text, "$filter",
                       detail="Supported: RegistryPrefix, ResourceType and OriginResource with eq, joined by or "
                              "(one property) and and (different properties).")
    seen: set[str] = set()
    for clause in re.split(r"\s+and\s+", text.strip()):
        clause = clause.strip()
        if clause.startswith("(") and clause.endswith(")"):
            clause = clause[1:-1].strip()
        names = set()
        for term in re.split(r"\s+or\s+", clause):
            match = _FILTER_TERM.match(term.strip())
            if match is None:
                raise bad
            names.add(match[1])
            lists[FILTER_PROPERTIES[match[1]]].append(match[2].rstrip("/") if match[1] == "OriginResource"
                                                      else match[2])
        if len(names) != 1 or names & seen:
            raise bad
        seen |= names
    return lists
