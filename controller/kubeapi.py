"""JSON requests and watch streams through the official client's transport (its kubeconfig, TLS and auth).

The controller works on plain dicts, not the generated models: the caches hold thousands of objects, the desired
children are dicts, and server-side apply takes a dict. So it uses the official client's ApiClient for what it is
good at (configuration, credentials, connection pool) and does the (de)serialisation itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kubernetes import client, config

Obj = dict[str, Any]
APPLY = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """The API server answered with an error Status (or could not be reached: status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def connect(kubeconfig: str = "") -> client.ApiClient:
    """From `kubeconfig`, else $KUBECONFIG / ~/.kube/config, else the in-cluster service account."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        return config.new_client_from_config()
    return client.ApiClient()


class KubeApi:
    def __init__(self, api_client: client.ApiClient, on_write: Any = None) -> None:
        self.api_client = api_client
        self.on_write = on_write  # called with (verb, path) after each successful write, for metrics

    def _prepare(self, method: str, path: str, query: dict[str, str] | None, content_type: str,
                 body: Any) -> tuple[str, str, dict[str, str], Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method_, url, headers, _body, _ = self.api_client.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()), header_params=headers,
            body=None, auth_settings=["BearerToken"])
        return method_, url, headers, body

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", timeout: float = 15.0) -> Obj:
        method_, url, headers, data = self._prepare(method, path, query, content_type, body)
        try:
            resp = self.api_client.rest_client.request(method_, url, headers=headers, body=data,
                                                       _request_timeout=timeout)
            raw = resp.read() or b""
        except client.ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.reason), str(exc.body)) from exc
        except Exception as exc:  # urllib3 and socket errors: the server could not be reached
            raise ApiError(0, "Unreachable", f"{method} {path}: {exc}") from exc
        try:
            payload: Any = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"message": raw.decode(errors="replace")}
        if resp.status >= 400:
            payload = payload if isinstance(payload, dict) else {}
            raise ApiError(resp.status, str(payload.get("reason") or resp.reason),
                           str(payload.get("message") or resp.reason))
        if method != "GET" and self.on_write is not None:
            self.on_write(method, path)
        return payload if isinstance(payload, dict) else {}

    def stream(self, path: str, query: dict[str, str], read_timeout: float) -> Iterator[Obj]:
        """The events of one watch request until the server ends it."""
        method_, url, headers, _ = self._prepare("GET", path, {**query, "watch": "true"}, "application/json", None)
        try:
            resp = self.api_client.rest_client.request(method_, url, headers=headers,
                                                       _request_timeout=(10, read_timeout))
        except Exception as exc:
            raise ApiError(0, "Unreachable", f"watch {path}: {exc}") from exc
        raw = resp.response
        try:
            if resp.status >= 400:
                try:
                    status = json.loads(raw.read())
                except ValueError:
                    status = {}
                raise ApiError(resp.status, str(status.get("reason", "")), str(status.get("message", "")))
            buffer = b""
            for chunk in raw.stream(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(0, "Unreachable", f"watch {path}: {exc}") from exc
        finally:
            raw.release_conn()
