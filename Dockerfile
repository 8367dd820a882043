# The one KubeVBMC image: its entry point is the `kubevbmc` command, so the controller's Deployment runs it with
# `controller ...` and every agent Deployment (made by the controller from --agent-image) with `agent ...`.
#
#   make image                  (scripts/image.py: podman/buildah or Docker, a local Debian base if none can be pulled)
#   docker build -t kubevbmc:dev .
#
# Both stages stand on Debian's own image and Debian's Python 3.11: a machine that cannot pull the base builds the
# same thing from Debian's packages (mmdebstrap, scripts/image.py), so the image tested here is the one a release builds.
# The builder makes a wheel of the project and installs it, with the runtime dependencies pinned by
# constraints.txt and none of the `sim`, `test` or `bench` extras, into a virtualenv at /opt/kubevbmc; the final
# stage adds Debian's python3 to the base and holds only that virtualenv.
#
# Reproducible inputs: the Python packages are pinned by constraints.txt, the Debian ones are those of the base's
# suite (DEBIAN_SNAPSHOT pins them to a snapshot.debian.org date), and SOURCE_DATE_EPOCH makes the wheel and the
# bytecode (hash-based .pyc) independent of the build's clock. /opt/kubevbmc/share/kubevbmc/packages.txt lists
# every Python and Debian package the image holds, with its version.

ARG BASE=docker.io/library/debian:bookworm-slim

FROM ${BASE} AS builder
ARG SOURCE_DATE_EPOCH=1700000000
ARG DEBIAN_SNAPSHOT=""
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH}
COPY scripts/debian-packages.sh /usr/local/sbin/debian-packages
RUN debian-packages python3-venv ca-certificates
RUN python3 -m venv /opt/kubevbmc
WORKDIR /src
# The runtime dependencies first, pinned, in a layer of their own: a change of the code alone does not download
# them again.
COPY pyproject.toml constraints.txt ./
RUN python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > dependencies.txt \
 && /opt/kubevbmc/bin/pip install --constraint constraints.txt --requirement dependencies.txt
# The kubernetes package carries an asyncio client (kubernetes.aio: 68 MB with its bytecode, a fifth of the image)
# and requires aiohttp for it alone; nothing of KubeVBMC imports either, so both go, with what only aiohttp needs.
RUN rm -r /opt/kubevbmc/lib/python3.11/site-packages/kubernetes/aio \
 && /opt/kubevbmc/bin/pip uninstall --yes --quiet aiohttp aiohttp-retry aiohappyeyeballs aiosignal attrs frozenlist \
    multidict propcache yarl
# What the wheel is built from, and nothing else (tests, charts and docs stay out of the image).
COPY README.md ./
COPY vbmc/ vbmc/
COPY controller/ controller/
COPY kubesim/ kubesim/
RUN /opt/kubevbmc/bin/pip wheel --no-deps --wheel-dir /wheels .
RUN /opt/kubevbmc/bin/pip install --no-deps --constraint constraints.txt /wheels/kubevbmc-*.whl
# The pods never install anything: pip and setuptools leave the virtualenv, and what stays is listed.
RUN /opt/kubevbmc/bin/pip uninstall --yes --quiet pip setuptools \
 && mkdir -p /opt/kubevbmc/share/kubevbmc \
 && /opt/kubevbmc/bin/python -c "import importlib.metadata as m; print(*sorted(f'{d.name}=={d.version}' for d in m.distributions()), sep='\n')" > /opt/kubevbmc/share/kubevbmc/python-packages.txt

FROM ${BASE}
ARG VERSION=0.2.0
ARG SOURCE_DATE_EPOCH=1700000000
ARG DEBIAN_SNAPSHOT=""
ARG BASE
LABEL org.opencontainers.image.title="kubevbmc" \
      org.opencontainers.image.description="A virtual BMC (IPMI and Redfish) for every KubeVirt virtual machine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kubevbmc/kubevbmc" \
      org.opencontainers.image.base.name="${BASE}"
COPY scripts/debian-packages.sh /usr/local/sbin/debian-packages
# Debian's python3 (the interpreter the virtualenv was made with) and the CA bundle (virtual media over HTTPS).
RUN debian-packages python3 ca-certificates
COPY --from=builder /opt/kubevbmc /opt/kubevbmc
RUN dpkg-query --show --showformat='${Package}=${Version}\n' > /opt/kubevbmc/share/kubevbmc/debian-packages.txt
# The pods run with a read-only root filesystem: bytecode was compiled at install time, nothing is written now.
ENV PATH=/opt/kubevbmc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# A numeric user (no passwd entry needed), the one the Deployments' runAsUser names.
USER 65532:65532
# The agent's unprivileged ports (its Service maps 623/UDP, 80/TCP and 443/TCP onto them).
EXPOSE 10623/udp 10080/tcp 10443/tcp
ENTRYPOINT ["/opt/kubevbmc/bin/kubevbmc"]
CMD ["--help"]
