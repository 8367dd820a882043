"""`kubevbmc agent`: the command line of the agent process (vbmc/agent/runtime.py serves what it asks for).

Without --pool, one BMC for one VM, from the flags and VBMC_USERNAME/VBMC_PASSWORD (a dedicated agent); with
--pool, every member of a pool, from the pool's Secret (or a file). Both are the same runtime serving the same BMC
composition (vbmc/agent/bmc.py): a dedicated agent is a pool of one. SIGTERM stops everything within two seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import ssl
import sys
from dataclasses import dataclass

from ..machine.kubevirt import vmstate
from .bmc import BmcSpec
from .logs import configure_logging
from .pool import file_source, secret_source
from .runtime import Agent, Settings, fixed_source, lazy_url_builders, shared_rule_parts

log = logging.getLogger("vbmc.agent")

# Connections the KubeClient keeps for reuse (its urllib3 pool's maxsize). A dedicated agent: its three watch
# streams, their three probes (vbmc/machine/kubevirt/watch.py) and a write; a smaller pool would open a new TLS
# connection for a probe and throw it away afterwards, every few seconds. A pool: each member holds as many, so
# this covers about 290 members at their busiest; past it, connections still open but are closed after use.
DEDICATED_CONNECTIONS, POOL_CONNECTIONS = 8, 2048


@dataclass
class AgentConfig:
    namespace: str
    vm: str
    vmbmc: str
    username: str
    password: str
    backend: str = "kubevirt"
    ipmi_address: str = "0.0.0.0:10623"
    redfish_address: str = "0.0.0.0:10080"
    redfish: bool = True  # False: the HTTP listener serves /healthz and /readyz only
    redfish_tls_address: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    kubeconfig: str = ""
    threads: int = 2
    subscriptions_secret: str = ""  # where Redfish event subscriptions are kept; empty: in memory
    log_config_map: str = ""  # where the SEL and the audit trail are kept; empty: in memory
    event_ca_file: str = ""  # CA certificates, besides the system's, for HTTPS event destinations
    redfish_require_tls: bool = False  # refuse credentials over plain HTTP
    media_max_size: int = 64 * 2**30  # the largest image virtual media imports
    cdi_upload_proxy: str = ""  # CDI's upload proxy ("": CDIConfig's, else its Service)
    cdi_upload_proxy_ca: str = ""  # the CA file that verifies it
    keep_ejected_media: float = 120.0  # seconds an ejected image's DataVolume waits for the same image again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--namespace", default=env("VBMC_NAMESPACE", ""), help="the VM's namespace")
    parser.add_argument("--vm", default=env("VBMC_VM", ""), help="the VirtualMachine's name")
    parser.add_argument("--vmbmc", default=env("VBMC_VMBMC", ""),
                        help="the VirtualMachineBMC (its status keeps the boot-once record; Events go to it)")
    parser.add_argument("--ipmi-address", default=env("VBMC_IPMI_ADDRESS", "0.0.0.0:10623"), metavar="HOST:PORT",
                        help="UDP address for IPMI; empty disables IPMI (default %(default)s)")
    parser.add_argument("--redfish-address", default=env("VBMC_REDFISH_ADDRESS", "0.0.0.0:10080"),
                        metavar="HOST:PORT", help="HTTP address for Redfish and /healthz, /readyz")
    parser.add_argument("--redfish", default=env("VBMC_REDFISH", "true"), choices=("true", "false"),
                        help="serve Redfish; false leaves the HTTP listener to /healthz and /readyz "
                             "(default %(default)s)")
    parser.add_argument("--redfish-tls-address", default=env("VBMC_REDFISH_TLS_ADDRESS", ""), metavar="HOST:PORT")
    parser.add_argument("--redfish-require-tls", default=env("VBMC_REDFISH_REQUIRE_TLS", "false"),
                        choices=("true", "false"),
                        help="refuse Redfish credentials (Basic, session login, session tokens) that come over plain "
                             "HTTP; the service root stays readable there (default %(default)s)")
    parser.add_argument("--media-max-size", default=env("VBMC_MEDIA_MAX_SIZE", "64Gi"), metavar="QUANTITY",
                        help="the largest image virtual media imports; a larger one is refused before anything is "
                             "created (default %(default)s)")
    parser.add_argument("--cdi-upload-proxy", default=env("VBMC_CDI_UPLOAD_PROXY", ""), metavar="URL",
                        help="CDI's upload proxy, for media uploaded from the web page (default: the CDIConfig's "
                             "status.uploadProxyURL when readable, else https://cdi-uploadproxy.cdi.svc)")
    parser.add_argument("--cdi-upload-proxy-ca", default=env("VBMC_CDI_UPLOAD_PROXY_CA", ""), metavar="FILE",
                        help="the CA certificates that verify the upload proxy (CDI's ConfigMap "
                             "cdi-uploadproxy-signer-bundle; default: the CDIConfig's status.uploadProxyCA, else the "
                             "system's and the cluster's CAs)")
    parser.add_argument("--keep-ejected-media", type=float, default=env("VBMC_KEEP_EJECTED_MEDIA", "120"),
                        metavar="SECONDS",
                        help="how long an ejected image's imported DataVolume is kept for an insert of the same image "
                             "(Ironic ejects before every insert); 0 deletes it at the eject (default %(default)s)")
    parser.add_argument("--tls-cert", default=env("VBMC_TLS_CERT", ""), metavar="FILE")
    parser.add_argument("--tls-key", default=env("VBMC_TLS_KEY", ""), metavar="FILE")
    parser.add_argument("--subscriptions-secret", default=env("VBMC_SUBSCRIPTIONS_SECRET", ""), metavar="NAME",
                        help="the Secret (in --namespace) that keeps the Redfish event subscriptions, so that they "
                             "outlive the process; empty: in memory (the controller passes its own)")
    parser.add_argument("--log-config-map", default=env("VBMC_LOG_CONFIG_MAP", ""), metavar="NAME",
                        help="the ConfigMap (in --namespace) that keeps the SEL and the audit trail, so that they "
                             "outlive the process; created on the first entry, owned by --vmbmc; empty: in memory "
                             "(the controller passes its own)")
    parser.add_argument("--event-ca-file", default=env("VBMC_EVENT_CA_FILE", ""), metavar="FILE",
                        help="CA certificates trusted, besides the system's, for HTTPS event destinations")
    parser.add_argument("--backend", choices=("kubevirt", "memory"), default=env("VBMC_BACKEND", "kubevirt"),
                        help="memory: an in-memory machine, no cluster (protocol tests and benchmarks)")
    parser.add_argument("--kubeconfig", default="", help="default: $KUBECONFIG, else in-cluster")
    # Two threads: one slow backend call does not block every client, and fewer threads fight less over the GIL
    # (measured with bench/agent.py: 8 threads give p99 20 ms, 2 give 13 ms, at 8 keep-alive connections).
    # Connections take no thread: stalled and idle clients wait on the server's event loop.
    parser.add_argument("--threads", type=int, default=2, help="Redfish worker threads (default %(default)s)")
    pool = parser.add_argument_group("pooled agent (one process for many VirtualMachineBMCs, vbmc/agent/pool.py)")
    pool.add_argument("--pool", default=env("VBMC_POOL", ""), metavar="NAME",
                      help="serve the members of this pool instead of one VM (--vm, VBMC_USERNAME and "
                           "--ipmi-address are then not used)")
    pool.add_argument("--pool-secret", default=env("VBMC_POOL_SECRET", ""), metavar="NAME",
                      help="the Secret (in --namespace) whose pool.json lists the members; watched")
    pool.add_argument("--pool-file", default=env("VBMC_POOL_FILE", ""), metavar="PATH",
                      help="a pool.json file instead of the Secret, read about once a second (tests, benchmarks)")
    pool.add_argument("--address", default=env("VBMC_ADDRESS", "0.0.0.0"), metavar="HOST",
                      help="the address members' ports are bound on (the pod IP; default %(default)s)")
    parser.add_argument("--log-level", default=env("VBMC_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", default=env("VBMC_LOG_FORMAT", "text"), choices=("text", "json"),
                        help="text lines, or json: one object per line, audit fields as keys (default %(default)s)")


def config_from(args: argparse.Namespace) -> AgentConfig:
    username, password = os.environ.get("VBMC_USERNAME", ""), os.environ.get("VBMC_PASSWORD", "")
    problems = []
    if not username or not password:
        problems.append("VBMC_USERNAME and VBMC_PASSWORD must be set (the BMC's credentials)")
    if not args.vm:
        problems.append("--vm is required")
    if args.backend == "kubevirt" and not args.namespace:
        problems.append("--namespace is required with the kubevirt backend")
    if args.redfish_tls_address and args.redfish == "false":
        problems.append("--redfish-tls-address serves Redfish: it cannot go with --redfish false")
    if args.redfish_tls_address and not (args.tls_cert and args.tls_key):
        problems.append("--redfish-tls-address needs --tls-cert and --tls-key")
    if args.subscriptions_secret and args.backend != "kubevirt":
        problems.append("--subscriptions-secret needs the kubevirt backend")
    if args.log_config_map and (args.backend != "kubevirt" or not args.vmbmc):
        problems.append("--log-config-map needs the kubevirt backend and --vmbmc (the ConfigMap's owner)")
    if vmstate.quantity_bytes(args.media_max_size) <= 0:
        problems.append(f"--media-max-size {args.media_max_size!r} is not a size (such as 64Gi)")
    if not 0 <= args.keep_ejected_media <= 86400:
        problems.append("--keep-ejected-media must be between 0 and 86400 seconds")
    for path in (args.tls_cert, args.tls_key, args.event_ca_file, args.cdi_upload_proxy_ca):
        if path and not os.path.exists(path):
            problems.append(f"{path} does not exist")
    if problems:
        raise ValueError("; ".join(problems))
    return AgentConfig(namespace=args.namespace or "default", vm=args.vm, vmbmc=args.vmbmc, username=username,
                       password=password, backend=args.backend, ipmi_address=args.ipmi_address,
                       redfish_address=args.redfish_address, redfish=args.redfish != "false",
                       redfish_tls_address=args.redfish_tls_address,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, kubeconfig=args.kubeconfig,
                       threads=args.threads, subscriptions_secret=args.subscriptions_secret,
                       log_config_map=args.log_config_map,
                       event_ca_file=args.event_ca_file, redfish_require_tls=args.redfish_require_tls == "true",
                       media_max_size=vmstate.quantity_bytes(args.media_max_size),
                       cdi_upload_proxy=args.cdi_upload_proxy, cdi_upload_proxy_ca=args.cdi_upload_proxy_ca,
                       keep_ejected_media=args.keep_ejected_media)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass
class PoolSettings:
    pool: str
    namespace: str
    address: str  # host the members' ports are bound on (the pod IP)
    redfish_address: str  # host:port of the pool's own port: probes and metrics
    secret: str = ""
    file: str = ""
    backend: str = "kubevirt"
    kubeconfig: str = ""
    threads: int = 2  # Redfish worker threads per member
    event_ca_file: str = ""
    media_max_size: int = 64 * 2**30
    cdi_upload_proxy: str = ""
    cdi_upload_proxy_ca: str = ""
    keep_ejected_media: float = 120.0


def settings_from(args: argparse.Namespace) -> PoolSettings:
    problems = []
    if bool(args.pool_secret) == bool(args.pool_file):
        problems.append("--pool needs exactly one of --pool-secret (the controller's) and --pool-file")
    if args.pool_secret and args.backend != "kubevirt":
        problems.append("--pool-secret needs the kubevirt backend")
    if args.backend == "kubevirt" and not args.namespace:
        problems.append("--namespace is required with the kubevirt backend")
    if not args.redfish_address:
        problems.append("--redfish-address (the pool's probes and metrics) must not be empty")
    if vmstate.quantity_bytes(args.media_max_size) <= 0:
        problems.append(f"--media-max-size {args.media_max_size!r} is not a size (such as 64Gi)")
    if not 0 <= args.keep_ejected_media <= 86400:
        problems.append("--keep-ejected-media must be between 0 and 86400 seconds")
    for path in (args.event_ca_file, args.cdi_upload_proxy_ca):
        if path and not os.path.exists(path):
            problems.append(f"{path} does not exist")
    if args.threads < 1:
        problems.append("--threads must be at least 1")
    if problems:
        raise ValueError("; ".join(problems))
    return PoolSettings(pool=args.pool, namespace=args.namespace or "default", address=args.address or "0.0.0.0",
                        redfish_address=args.redfish_address, secret=args.pool_secret, file=args.pool_file,
                        backend=args.backend, kubeconfig=args.kubeconfig, threads=args.threads,
                        event_ca_file=args.event_ca_file, media_max_size=vmstate.quantity_bytes(args.media_max_size),
                        cdi_upload_proxy=args.cdi_upload_proxy, cdi_upload_proxy_ca=args.cdi_upload_proxy_ca,
                        keep_ejected_media=args.keep_ejected_media)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def dedicated(config: AgentConfig) -> tuple[Settings, BmcSpec]:
    """A dedicated agent's runtime settings and its one BMC. Raises OSError (or ValueError) when a certificate
    file cannot be read."""
    ipmi_host, ipmi_port = _host_port(config.ipmi_address) if config.ipmi_address else ("", 0)
    http_host, http_port = _host_port(config.redfish_address) if config.redfish_address else ("", 0)
    https_host, https_port = _host_port(config.redfish_tls_address) if config.redfish_tls_address else ("", 0)
    spec = BmcSpec(name=config.vmbmc, vm=config.vm, username=config.username, password=config.password,
                   ipmi_port=ipmi_port, http_port=http_port, https_port=https_port, ipmi=bool(config.ipmi_address),
                   redfish=config.redfish, require_tls=config.redfish_require_tls,
                   tls_cert=_read(config.tls_cert) if config.tls_cert else "",
                   tls_key=_read(config.tls_key) if config.tls_key else "",
                   subscriptions_secret=config.subscriptions_secret, log_config_map=config.log_config_map,
                   ipmi_host=ipmi_host, http_host=http_host, https_host=https_host)
    settings = Settings(namespace=config.namespace, backend=config.backend, threads=config.threads,
                        event_ca_file=config.event_ca_file, media_max_size=config.media_max_size,
                        cdi_upload_proxy=config.cdi_upload_proxy, cdi_upload_proxy_ca=config.cdi_upload_proxy_ca,
                        keep_ejected_media=config.keep_ejected_media)
    return settings, spec


def raise_descriptor_limit() -> None:
    """A pool holds about 7 descriptors a member, and a container's soft limit may be 1,024 (its hard limit is far
    higher): the soft limit is raised to the hard one, as Go programs do at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("pool: descriptor limit stays at %d: %s", soft, exc)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    pooled = bool(getattr(args, "pool", ""))
    try:
        if pooled:
            pool = settings_from(args)
            settings = Settings(namespace=pool.namespace, pool=pool.pool, address=pool.address,
                                redfish_address=pool.redfish_address, backend=pool.backend, threads=pool.threads,
                                event_ca_file=pool.event_ca_file, media_max_size=pool.media_max_size,
                                cdi_upload_proxy=pool.cdi_upload_proxy, cdi_upload_proxy_ca=pool.cdi_upload_proxy_ca,
                                keep_ejected_media=pool.keep_ejected_media,
                                source=pool.file or f"Secret {pool.secret}")
            kubeconfig, backend = pool.kubeconfig, pool.backend
        else:
            config = config_from(args)
            settings, spec = dedicated(config)
            kubeconfig, backend = config.kubeconfig, config.backend
    except (ValueError, OSError) as exc:
        print(f"kubevbmc agent: {exc}", file=sys.stderr)
        return 2
    lazy_url_builders()
    shared_rule_parts()
    if pooled:
        raise_descriptor_limit()
    kube = None
    if backend == "kubevirt":
        from ..machine.kubevirt.client import KubeClient, Unreachable, load_credentials

        try:
            kube = KubeClient(load_credentials(kubeconfig or None),
                              maxsize=POOL_CONNECTIONS if pooled else DEDICATED_CONNECTIONS)
        except (Unreachable, OSError, ssl.SSLError) as exc:
            log.error("%s: cannot reach the Kubernetes API: %s", "pool" if pooled else "agent", exc)
            return 1
    agent = Agent(settings, kube)
    if pooled:
        source = (file_source(agent, pool.file) if pool.file
                  else secret_source(agent, kube, pool.namespace, pool.secret))
    else:
        source = fixed_source(agent, [spec])
        log.info("agent: serving vm=%s/%s ipmi=%s redfish=%s redfish-tls=%s backend=%s", config.namespace, config.vm,
                 config.ipmi_address or "-", (config.redfish_address or "-") if config.redfish else "off",
                 config.redfish_tls_address or "-", config.backend)
        if config.redfish_require_tls and config.redfish and not config.redfish_tls_address:
            log.warning("agent: --redfish-require-tls without --redfish-tls-address: every Redfish request with "
                        "credentials is refused until the agent serves HTTPS")
    try:
        asyncio.run(agent.run(source))
    except OSError as exc:
        log.error("pool: cannot serve on %s: %s", settings.redfish_address, exc)
        return 1
    finally:
        if kube is not None:
            kube.close()
    if agent.failed:
        log.error("agent: cannot serve Redfish: %s", agent.failed)
        return 1
    return 0
