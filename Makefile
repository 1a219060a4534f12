# AgentBox: `make run` sets up this machine and runs the daemon; `make test` runs the suite.
PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CONFIG  ?= config/agentbox.toml
LISTEN  ?=
DATA_DIR ?=
SERVE_ARGS := --config $(CONFIG) $(if $(LISTEN),--listen $(LISTEN)) $(if $(DATA_DIR),--data-dir $(DATA_DIR))
PYTEST_ARGS ?=

.PHONY: setup host-packages venv images test-images run test test-unit test-e2e test-cluster test-fleet \
        test-firecracker \
        kernel-firecracker bench chaos lint clean

setup: host-packages venv

host-packages:
	@bash scripts/setup-host.sh

venv: $(VENV)/.installed

# Two distributions: the server (this directory, `agentbox-server`) and the Python SDK with the
# client CLI (sdk/python, `agentbox`), with every extra the test suite exercises.
SDK_EXTRAS := mcp,langchain,crewai,shell
$(VENV)/.installed: pyproject.toml sdk/python/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' -e 'sdk/python[$(SDK_EXTRAS)]'
	@touch $@

# Build the configured templates and their golden snapshots (cached by content hash).
images: setup
	$(BIN)/agentbox-server images build --config $(CONFIG) $(if $(DATA_DIR),--images-dir $(DATA_DIR)/images)

# `make run` waits only for the default template (RUN_TEMPLATE); the daemon builds the other
# configured templates in the background, one at a time at low priority (docs/images.md).
RUN_TEMPLATE ?= python
run: setup
	$(BIN)/agentbox-server images build $(RUN_TEMPLATE) --config $(CONFIG) $(if $(DATA_DIR),--images-dir $(DATA_DIR)/images)
	$(BIN)/agentbox-server serve $(SERVE_ARGS)

# The e2e suite serves the templates in its own config (python + python-datascience); it does
# not need the other templates `make run` serves (node, minimal are built by the daemon).
TEST_CONFIG := tests/e2e/agentbox-test.toml
test-images: setup
	$(BIN)/agentbox-server images build --config $(TEST_CONFIG)

test: setup test-images
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-e2e: setup test-images
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

# The cluster foundation against a real 3-member etcd in network namespaces (docs/cluster.md);
# its fleet tests (real daemons and VMs, one per host namespace) skip without the goldens.
test-cluster: setup
	$(BIN)/python -m pytest tests/cluster -s -rs $(PYTEST_ARGS)

# Only the fleet of real daemons (tests/cluster/fleet_env.py), images built first (~2.5 min).
test-fleet: setup test-images
	$(BIN)/python -m pytest tests/cluster/test_fleet_smoke.py tests/cluster/test_fleet_e2e.py \
	    -s -rs $(PYTEST_ARGS)

# Opt-in: compiles a Firecracker-ready vmlinux from Debian's linux-source (minutes).
kernel-firecracker: setup
	bash images/firecracker/build_kernel.sh

# The real end-to-end suite under a real `firecracker` binary (skips where it or KVM is missing):
# 1) the Firecracker tests (kernel under QEMU microvm, driver with real firecracker, the daemon
#    API with vmm = "firecracker"); 2) every daemon-backed e2e suite against a Firecracker daemon.
FC_E2E_CONFIG := tests/e2e/agentbox-firecracker-test.toml
test-firecracker: images
	$(BIN)/python -m pytest tests/e2e -k firecracker -rs $(PYTEST_ARGS)
	@reason="$$($(BIN)/python -m tests.e2e.firecracker_env $(FC_E2E_CONFIG))" || exit 1; \
	if [ -n "$$reason" ]; then echo "SKIPPED: the e2e suite under Firecracker: $$reason"; \
	else AGENTBOX_E2E_CONFIG=$(FC_E2E_CONFIG) $(BIN)/python -m pytest tests/e2e \
	    -k "not firecracker" --ignore=tests/e2e/test_image_boot.py -rs $(PYTEST_ARGS); fi

# Long chaos run for operators (issue 9): random daemon/VMM kills for CHAOS_SECONDS (30 min).
CHAOS_SECONDS ?= 1800
chaos: images test-images
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(BIN)/python -m pytest tests/e2e/test_chaos.py -k random -s $(PYTEST_ARGS)

bench: images
	$(BIN)/python bench/lifecycle.py

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info sdk/python/*.egg-info .pytest_cache

# The TypeScript SDK: npm dependencies from its lock file, then tsc (make test builds it too).
.PHONY: sdk-ts
sdk-ts:
	cd sdk/typescript && npm ci --no-audit --no-fund && npm run build
