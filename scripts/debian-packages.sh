#!/bin/sh
# Installs Debian packages in an image build (Dockerfile: `debian-packages python3 ca-certificates`) and leaves
# nothing behind that differs from one build to the next: no package lists, apt caches or logs.
# With DEBIAN_SNAPSHOT (a snapshot.debian.org timestamp such as 20250520T000000Z) the packages come from that day's
# archive, so every build of a release installs the same versions.
set -eu
. /etc/os-release
if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
  rm -f /etc/apt/sources.list.d/debian.sources
  archive=http://snapshot.debian.org/archive
  cat > /etc/apt/sources.list <<SOURCES
deb $archive/debian/$DEBIAN_SNAPSHOT $VERSION_CODENAME main
deb $archive/debian/$DEBIAN_SNAPSHOT $VERSION_CODENAME-updates main
deb $archive/debian-security/$DEBIAN_SNAPSHOT $VERSION_CODENAME-security main
SOURCES
fi
export DEBIAN_FRONTEND=noninteractive
apt_options=""
[ -n "${DEBIAN_SNAPSHOT:-}" ] && apt_options="-o Acquire::Check-Valid-Until=false"
# shellcheck disable=SC2086
apt-get $apt_options update -qq
# shellcheck disable=SC2086
apt-get $apt_options install -qq --yes --no-install-recommends "$@" >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /var/log/alternatives.log /var/cache/debconf/*-old \
       /var/cache/ldconfig/aux-cache
