# The two commands a newcomer needs: `make demo` and `make test`. Each creates the virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv clients guests image test lint unit demo sim bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[sim,test]'
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

# The tools the tests drive (ipmitool, freeipmi-tools, podman, runc, mmdebstrap, promtool, chromium and
# chromium-driver): apt-get installs them when missing (sudo if not root); OpenStack Ironic, a real consumer
# the tests run, in its own virtualenv (.venv-ironic).
clients:
	scripts/install-clients.sh
	scripts/install-ironic.sh

# The test guests real VMs boot (kubesim --guests qemu): built from Debian's packages into ~/.cache/kubevbmc/guests,
# with QEMU, OVMF and iPXE's ROMs installed when missing (apt-get): scripts/build-guests.sh.
guests:
	scripts/build-guests.sh

# The container image, from the Dockerfile, into the storage kubesim's container kubelet runs it from (podman or
# buildah, else Docker; a base made from Debian's packages where no registry answers): scripts/image.py.
image: venv
	$(BIN)/python scripts/image.py

# The tests on TEST_WORKERS processes (pytest-xdist), a test module each at a time (a module's fixtures, such as its
# own kubesim or the Ironic lab, live in one process), the slowest modules first (tests/conftest.py); each worker
# claims its own loopback slot. The slowest tests are listed at the end.
TEST_WORKERS ?= 3
unit: venv clients guests image
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations 25

# Lint, type-check, then every test (real clients included, installed when missing: a missing one fails, never skips).
test: lint unit

# Where QEMU is installed the demo's VMs are real guests, booting the test guests (built first).
demo: venv
	if command -v qemu-system-x86_64 >/dev/null; then scripts/build-guests.sh; fi
	$(BIN)/kubevbmc demo

sim: venv
	$(BIN)/kubevbmc sim

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install -q -c constraints.txt -e '.[sim,test,bench]'
	touch $@

# Benchmarks print figures next to a peer measured in the same run; they need ipmitool and wrk (apt-get).
bench: $(VENV)/.bench-installed
	$(BIN)/python bench/sim.py
	$(BIN)/python bench/agent.py
	$(BIN)/python bench/slow_clients.py
	$(BIN)/python bench/controller.py
	$(BIN)/python bench/services.py
	$(BIN)/python bench/idle.py
	$(BIN)/python bench/apply.py
	$(BIN)/python bench/redfish_fuzz.py
	$(BIN)/python bench/ipmi_fuzz.py
	$(BIN)/python bench/consoles.py
	$(BIN)/python bench/guests.py

clean:
	rm -rf $(VENV) .venv-ironic .mypy_cache .ruff_cache .pytest_cache *.egg-info
	rm -rf .containers
