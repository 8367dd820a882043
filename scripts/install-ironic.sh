#!/usr/bin/env bash
# OpenStack Ironic (standalone) for the test suite's real-consumer tests (tests/ironic/), in its own virtualenv:
# Ironic pins its own dependency tree (oslo.*, eventlet...), which must not mix with the project's. Pinned by
# scripts/ironic-constraints.txt. Used by `make test` and by CI (.ci/run); does nothing when the virtualenv already
# holds the pinned versions (a stamp of the constraints file), so a second run takes a moment.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${IRONIC_VENV:-.venv-ironic}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=scripts/ironic-constraints.txt
STAMP="$VENV/.installed"

if [ -x "$VENV/bin/ironic" ] && [ -f "$STAMP" ] && cmp -s "$STAMP" "$CONSTRAINTS"; then
  exit 0
fi
echo "install-ironic: installing Ironic into $VENV" >&2
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
ironic=$(grep -E '^ironic==' "$CONSTRAINTS")
sushy=$(grep -E '^sushy==' "$CONSTRAINTS")
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" "$ironic" "$sushy"
"$VENV/bin/python" -c 'import ironic, sushy' || { echo "install-ironic: Ironic does not import" >&2; exit 1; }
[ -x "$VENV/bin/ironic" ] || { echo "install-ironic: no ironic command in $VENV" >&2; exit 1; }
cp "$CONSTRAINTS" "$STAMP"
