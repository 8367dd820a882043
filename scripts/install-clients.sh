#!/usr/bin/env bash
# The real tools the tests drive, installed from Debian/Ubuntu packages when one is missing: the IPMI clients
# (ipmitool; freeipmi's ipmipower, ipmi-chassis, bmc-info), what builds and runs the image (podman with runc, and
# mmdebstrap for a base where no registry answers), promtool (Prometheus' rule checker, in Debian's prometheus
# package) and Chromium with its WebDriver (the BMC's page). Used by `make test` and by CI (.ci/run). Does nothing
# when every tool is present; uses sudo only when not root.
set -euo pipefail

# command -> the Debian package that provides it
declare -A package_of=(
  [ipmitool]=ipmitool
  [ipmipower]=freeipmi-tools
  [ipmi-chassis]=freeipmi-tools
  [bmc-info]=freeipmi-tools
  [podman]=podman
  [runc]=runc
  [mmdebstrap]=mmdebstrap
  [promtool]=prometheus
  [chromium]=chromium
  [chromedriver]=chromium-driver
)

missing=()
for tool in "${!package_of[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${package_of[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-clients: missing ${packages[*]} and no apt-get here: install them with your package manager" >&2
  exit 1
fi
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "install-clients: missing ${packages[*]}; run as root or install sudo" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
echo "install-clients: installing ${packages[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}"

for tool in "${!package_of[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "install-clients: '$tool' is still missing after installing ${package_of[$tool]}" >&2; exit 1; }
done
