"""Virtual media: the BMC's virtual CD, reachable from the Manager and from the System (Ironic and bmclib look
there): GET and PATCH of a slot, InsertMedia and EjectMedia, and the checks on an image URL."""

from __future__ import annotations

import ipaddress
import json
import re
from urllib.parse import urlsplit

from flask import Blueprint, Response, request

from ..access.audit import redact_url
from ..machine import ImageUnusable, Unsupported
from . import payloads, resources
from .errors import RedfishError, not_found
from .resources import TASKS
from .service import Rendered, Service
from .taskstore import follow

MAX_IMAGE_URL = 2048
# RFC 3986 reg-name, ASCII only (an internationalised host name is given in its punycode form).
_HOST = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=%-]+$")

IMAGE_CREDENTIALS = (
    "Image credentials are not stored by the BMC (it would have to create Secrets, which its Role cannot limit by "
    "name). Use an image URL that needs none, or put them in the URL (http://user:password@host/image.iso): the "
    "DataVolume then holds them, and the BMC shows the URL without them.")


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("media", __name__)
    machine, ids, cache = svc.machine, svc.ids, svc.cache
    bases = {ids.manager: f"{ids.manager}/VirtualMedia", ids.system: f"{ids.system}/VirtualMedia"}

    def rendered_media(base: str, slot: str) -> Rendered:
        if slot not in machine.media_slots():
            raise not_found(request.path)
        media = machine.virtual_media(slot)
        return cache.get(f"media:{base}:{slot}", "VirtualMedia", media,
                         lambda: resources.virtual_media(base, media))

    for owner, base in bases.items():
        # Two owners, the same views: endpoints named per owner, the base bound as a default argument.
        kind = "manager" if owner == ids.manager else "system"
        svc.route(bp, base, endpoint=f"collection_{kind}")(lambda base=base: media_collection(base))
        svc.route(bp, f"{base}/<slot>", ("GET", "PATCH"), endpoint=f"slot_{kind}")(
            lambda slot, base=base: media(base, slot))
        svc.route(bp, f"{base}/<slot>/Actions/VirtualMedia.InsertMedia", ("POST",), endpoint=f"insert_{kind}")(
            lambda slot, base=base: insert_media(base, slot))
        svc.route(bp, f"{base}/<slot>/Actions/VirtualMedia.EjectMedia", ("POST",), endpoint=f"eject_{kind}")(
            lambda slot, base=base: eject_media(base, slot))

    def media_collection(base: str) -> Response:
        slots = machine.media_slots()
        if not slots:
            raise not_found(request.path)
        return svc.send(cache.get(f"media_collection:{base}", "VirtualMediaCollection", slots,
                                  lambda: resources.collection("VirtualMediaCollection", base, "Virtual Media",
                                                               [f"{base}/{s}" for s in slots])))

    def media(base: str, slot: str) -> Response:
        current = rendered_media(base, slot)
        if request.method == "PATCH":
            svc.check_if_match(current)
            patch, refused = payloads.parse_partial_patch(payloads.MediaPatch, svc.body(), json.loads(current.body))
            try:
                if patch.Inserted is False or patch.Image == "":
                    machine.eject_media(slot)
                elif patch.Image is not None:
                    check_image(patch.Image, "Image", None)
                    try:
                        machine.check_image(patch.Image)  # before the eject: a refused image changes nothing
                    except ImageUnusable as exc:
                        raise unusable(patch.Image, exc, None) from None
                    shown = machine.virtual_media(slot)
                    if shown.inserted and shown.image != patch.Image:
                        machine.eject_media(slot)  # PATCHing a new Image replaces the medium, as on a real BMC
                    try:
                        machine.insert_media(patch.Image, slot,
                                             True if patch.WriteProtected is None else patch.WriteProtected)
                    except ImageUnusable as exc:
                        raise unusable(patch.Image, exc, None) from None
                elif patch.Inserted and not machine.virtual_media(slot).inserted:
                    raise RedfishError(400, "PropertyMissing", "Image", related="#/Image")
            except Unsupported as exc:
                # No drive behind the slot (a VM without a cdrom disk): the System's configuration is the conflict.
                name, value = ("Image", patch.Image) if patch.Image else ("Inserted", bool(patch.Inserted))
                raise RedfishError(409, "PropertyValueResourceConflict", name, value, ids.system,
                                   detail=str(exc), related=f"#/{name}") from None
            return svc.send(rendered_media(base, slot), etag=True, messages=refused)
        return svc.send(current, etag=True)

    def check_drive(base: str, slot: str, action: str) -> None:
        """404 for an unknown slot; ActionNotSupported, before the body is looked at, for one without a drive."""
        shown = json.loads(rendered_media(base, slot).body)
        if shown["Status"]["State"] == "Absent":
            raise RedfishError(400, "ActionNotSupported", action, detail=shown.get("Description", ""))

    def insert_media(base: str, slot: str) -> Response:
        action = "VirtualMedia.InsertMedia"
        check_drive(base, slot, action)
        parsed = payloads.parse_action(payloads.InsertMediaAction, svc.body(), action)
        for name, value in (("UserName", parsed.UserName), ("Password", parsed.Password)):
            if value:  # refused, never dropped: the import would fail later, with the reason out of sight
                raise RedfishError(400, "ActionParameterNotSupported", name, action, related=f"#/{name}",
                                   detail=IMAGE_CREDENTIALS)
        check_image(parsed.Image, "Image", action)
        scheme = parsed.Image.split(":", 1)[0].upper()
        if parsed.TransferProtocolType is not None and parsed.TransferProtocolType != scheme:
            # Honoured, not ignored: the importer fetches the Image's own scheme, so the two must agree.
            raise RedfishError(400, "ActionParameterValueError", "TransferProtocolType", action,
                               related="#/TransferProtocolType",
                               detail=f"TransferProtocolType {parsed.TransferProtocolType} does not match the Image "
                                      f"URL's scheme ({scheme}): the image is fetched as its URL says.")
        if not parsed.Inserted:
            raise RedfishError(400, "ActionParameterValueNotInList", "false", "Inserted", action,
                               detail="Only Inserted=true is supported.", related="#/Inserted")
        try:
            machine.insert_media(parsed.Image, slot, parsed.WriteProtected)
        except ImageUnusable as exc:
            # Refused at once, nothing created: a client that does not follow Tasks (sushy, and so Ironic) must not
            # take a 202 for an image that will never be in.
            raise unusable(parsed.Image, exc, action) from None
        task = follow(svc.tasks.add(slot, parsed.Image), machine)
        return svc.send_doc("Task", resources.task(task), 202, headers={"Location": f"{TASKS}/{task.id}"})

    def eject_media(base: str, slot: str) -> Response:
        check_drive(base, slot, "VirtualMedia.EjectMedia")
        payloads.parse_action(payloads.EjectMediaAction, svc.body(), "VirtualMedia.EjectMedia")
        machine.eject_media(slot)
        return svc.no_content()

    return bp


def image_url_problem(image: str) -> str | None:
    """Why `image` is not an http(s) URL the importer can fetch, or None when it is one."""
    if len(image) > MAX_IMAGE_URL:
        return f"The image URL is longer than {MAX_IMAGE_URL} characters."
    if any(c <= " " or c == "\x7f" for c in image):
        return "The image URL contains a space or a control character."
    try:
        parts = urlsplit(image)
        host, port = parts.hostname, parts.port  # both parse the authority, and raise on a malformed one
    except ValueError as exc:
        return f"The image URL is malformed: {exc}."
    if parts.scheme not in ("http", "https"):
        return "The image must be an http or https URL."
    if not host:
        return "The image URL has no host."
    if parts.netloc.rpartition("@")[2].startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return "The image URL's host is not an IPv6 address."
    elif not _HOST.match(host):
        return "The image URL's host is not a valid host name."
    if port == 0:
        return "The image URL's port is out of range."
    if not image.isascii():
        # RFC 3986: a URL is ASCII; the importer and the size check would refuse it later, or fail on it.
        return "The image URL contains a character that is not ASCII: percent-encode it (é is %C3%A9)."
    return None


def unusable(image: str, exc: ImageUnusable, action: str | None, name: str = "Image") -> RedfishError:
    """400 for an image the agent already knows cannot be imported (no such host, refused, 4xx, 5xx, too large, an
    untrusted certificate), naming the image and the reason. `name`: the property (Image, Boot's HttpBootUri)."""
    shown = redact_url(image)
    reason = str(exc)
    detail = f"The image cannot be inserted: {reason}." if shown in reason else \
        f"The image {shown} cannot be inserted: {reason}."
    related = "#/Boot/HttpBootUri" if name == "HttpBootUri" else f"#/{name}"
    if action is None:
        return RedfishError(400, "PropertyValueError", name, related=related, detail=detail)
    return RedfishError(400, "ActionParameterValueError", name, action, related=related, detail=detail)


def check_image(image: str, name: str, action: str | None) -> None:
    problem = image_url_problem(image)
    if problem is None:
        return
    if action is None:
        raise RedfishError(400, "PropertyValueFormatError", image, name, related=f"#/{name}", detail=problem)
    raise RedfishError(400, "ActionParameterValueFormatError", image, name, action, related=f"#/{name}",
                       detail=problem)
