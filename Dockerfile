# The one KubeVBMC image: its entry point is the `kubevbmc` command, so the controller's Deployment runs it with
# `controller ...` and every agent Deployment (made by the controller from --agent-image) with `agent ...`.
#
#   docker build -t kubevbmc:dev .
#
# Two stages on the same Python base (the virtualenv's interpreter is the base image's): the builder makes a wheel
# of the project and installs it, with the runtime dependencies pinned by constraints.txt and none of the `sim`,
# `test` or `bench` extras, into /opt/kubevbmc; the final stage holds only that virtualenv.

FROM python:3.11-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# What the wheel is built from, and nothing else (tests, charts and docs stay out of the image).
COPY pyproject.toml README.md constraints.txt ./
COPY vbmc/ vbmc/
COPY controller/ controller/
COPY kubesim/ kubesim/
RUN pip wheel --no-deps --wheel-dir /wheels .
RUN python -m venv /opt/kubevbmc
RUN /opt/kubevbmc/bin/pip install --constraint constraints.txt /wheels/kubevbmc-*.whl

FROM python:3.11-slim-bookworm
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kubevbmc" \
      org.opencontainers.image.description="A virtual BMC (IPMI and Redfish) for every KubeVirt virtual machine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"
COPY --from=builder /opt/kubevbmc /opt/kubevbmc
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
