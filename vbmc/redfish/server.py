"""Serving the Redfish app: gunicorn for the agent, a werkzeug thread for tests.

gunicorn runs one `gthread` worker (threads, keep-alive). The app factory, `on_worker_start` and
`on_worker_exit` all run inside that worker, after the fork: the agent builds its Machine, starts the IPMI
server and the backend's watch there, so that everything shares one process with the Flask app. TLS in gunicorn
is all-or-nothing per server; `RedfishWorker` wraps only the connections accepted on the HTTPS address, so one
worker serves both the HTTP and the HTTPS listener.

SIGTERM to the master stops the worker (graceful_timeout 1 s) and the master within two seconds."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import TConn, ThreadWorker

AppFactory = Callable[[], Any]  # returns a WSGI app (the Flask app of vbmc.redfish.app.create_app)
Hook = Callable[[], None]


@dataclass
class ServerConfig:
    http: str | None = "0.0.0.0:10080"  # "host:port"; None for HTTPS only
    https: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    threads: int = 8
    keepalive: int = 15  # seconds an idle keep-alive connection stays open
    graceful_timeout: int = 1  # SIGTERM: in-flight requests get this long, then the worker is killed
    log_level: str = "warning"
    extra: dict[str, Any] = field(default_factory=dict)  # any other gunicorn setting

    def binds(self) -> list[str]:
        binds = [b for b in (self.http, self.https) if b]
        if not binds:
            raise ValueError("nothing to listen on: give an HTTP or an HTTPS address")
        if self.https and not (self.certfile and self.keyfile):
            raise ValueError("an HTTPS address needs a certificate and a key file")
        for path in (self.certfile, self.keyfile):
            if path and not os.path.exists(path):
                raise ValueError(f"{path} does not exist")
        return binds


class _TLSSettings:
    """gunicorn's settings as seen by connections on the HTTPS listener: TLS on, one SSLContext reused
    (gunicorn would otherwise load the certificate chain again for every connection)."""

    def __init__(self, cfg: Any, context: ssl.SSLContext) -> None:
        self._cfg = cfg
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)

    @property
    def is_ssl(self) -> bool:
        return True

    def ssl_context(self, conf: Any, default_factory: Any) -> ssl.SSLContext:
        return self._context


class RedfishWorker(ThreadWorker):
    """A gthread worker that speaks TLS on the HTTPS listener only."""

    tls_port: int | None = None
    certfile: str = ""
    keyfile: str = ""

    def init_process(self) -> None:
        self._tls: _TLSSettings | None = None
        if self.tls_port is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.certfile, self.keyfile)
            self._tls = _TLSSettings(self.cfg, context)
        super().init_process()

    def accept(self, listener: socket.socket) -> None:
        tls = self._tls if self._tls is not None and listener.getsockname()[1] == self.tls_port else None
        if tls is None:
            super().accept(listener)
            return
        try:
            client_sock, client_addr = listener.accept()
        except BlockingIOError:
            return
        except OSError:
            return
        self.nr_conns += 1
        client_sock.setblocking(True)
        self.enqueue_req(TConn(tls, client_sock, client_addr, listener.getsockname()))

    def _cap_keepalive(self, deadline: float) -> None:
        # On SIGTERM gthread lets idle keep-alive connections linger for up to a second, as long as the
        # master's whole grace period: the master could SIGKILL the worker before its exit hook (which stops
        # IPMI) runs. A BMC has nothing to finish on an idle connection: close them at once.
        super()._cap_keepalive(time.monotonic())


class RedfishServer(BaseApplication):
    """gunicorn with one worker serving `app_factory()`."""

    def __init__(self, app_factory: AppFactory, config: ServerConfig, *, on_worker_start: Hook | None = None,
                 on_worker_exit: Hook | None = None) -> None:
        self.app_factory = app_factory
        self.config = config
        self.on_worker_start = on_worker_start
        self.on_worker_exit = on_worker_exit
        super().__init__()

    def load_config(self) -> None:
        c = self.config
        binds = c.binds()
        worker = type("BoundRedfishWorker", (RedfishWorker,), {
            "tls_port": _port(c.https) if c.https else None,
            "certfile": c.certfile or "", "keyfile": c.keyfile or ""})
        settings: dict[str, Any] = {
            "bind": binds, "workers": 1, "worker_class": worker, "threads": c.threads,
            "keepalive": c.keepalive, "graceful_timeout": c.graceful_timeout, "timeout": 30,
            "loglevel": c.log_level, "accesslog": None, "preload_app": False,
            "post_worker_init": self._post_worker_init, "worker_exit": self._worker_exit,
            # No control socket: nothing administers the agent through it, and it would cost the master asyncio.
            "control_socket_disable": True,
            **c.extra,
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        # Called in the worker after the fork (preload_app is off), so the app and its Machine live there.
        return self.app_factory()

    def _post_worker_init(self, worker: Any) -> None:
        if self.on_worker_start is not None:
            self.on_worker_start()

    def _worker_exit(self, server: Any, worker: Any) -> None:
        if self.on_worker_exit is not None:
            self.on_worker_exit()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def serve(app_factory: AppFactory, config: ServerConfig, *, on_worker_start: Hook | None = None,
          on_worker_exit: Hook | None = None) -> None:
    """Run gunicorn in the foreground until SIGTERM/SIGINT (the agent's main loop)."""
    RedfishServer(app_factory, config, on_worker_start=on_worker_start, on_worker_exit=on_worker_exit).run()


class ThreadedServer:
    """The app on werkzeug's threaded server in a background thread: for tests and benchmarks, not the agent."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        from werkzeug.serving import make_server

        self._server = make_server(host, port, app, threaded=True, ssl_context=ssl_context)
        self.port = self._server.server_port
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="redfish-test-server",
                                        daemon=True)

    def start(self) -> ThreadedServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
