# poet-edge: the README's first commands. Everything runs inside .venv, created by `make setup`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= out/demo

.PHONY: setup demo test test-fast lint bench clean

# Debian packages for the Cortex-M firmware: its cross compiler and C library, QEMU's mps2-an386 board, and
# nanopb's generator with protoc (nanopb's C runtime comes from Debian's source archive: `make deps` there).
FIRMWARE_DIR := device_agent/firmware/cortex_m
FIRMWARE_DEBS := gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm nanopb protobuf-compiler

setup: $(STAMP)
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || { apt-get update && apt-get install -y --no-install-recommends postgresql; } || echo "PostgreSQL not installed: the run store's PostgreSQL tests will skip"
	@dpkg -s $(FIRMWARE_DEBS) >/dev/null 2>&1 || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(FIRMWARE_DEBS); }
	@$(MAKE) -s -C $(FIRMWARE_DIR) deps

# Idempotent: re-runs only when the project metadata or the pins change. The protobuf stubs are
# committed (regenerate with `$(BIN)/python -m device_agent.protos` after editing a .proto).
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# constraints.txt pins the CPU wheel of exactly torch 2.13.0; pyproject's range alone pulls a CUDA build.
	# the flower extra: flwr beside poet-edge in one environment (pip check clean; see pyproject.toml)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,flower]"
	@touch $(STAMP)

demo: setup
	@mkdir -p $(DEMO_DIR)
	$(BIN)/poet platforms
	$(BIN)/poet solve --model resnet18_cifar --platform a72 --ram-budget 50% --runtime-budget 1.2 \
		--plot $(DEMO_DIR) --out $(DEMO_DIR)/resnet18_cifar_a72.schedule.json
	# run the Pi 4 schedule here: 3 real training steps with its page-outs and page-ins to flash
	$(BIN)/poet train --model resnet18_cifar --platform a72 --ram-budget 50% --flash-dir $(DEMO_DIR) --steps 3 \
		--schedule $(DEMO_DIR)/resnet18_cifar_a72.schedule.json
	# profile this machine, solve for it at half the no-remat peak, train: predicted against measured
	$(BIN)/poet demo --model resnet18_cifar --flash-dir $(DEMO_DIR) --steps 3
	# the fleet: a coordinator and two boards on loopback, each fine-tuning on its own data and budget
	$(BIN)/python -m host.fleet.demo --dir $(DEMO_DIR)/fleet
	# a Cortex-M4 on QEMU: mlp at batch 160 does not fit its 256 KiB arena plainly; its schedule pages to flash,
	# and the board's parameters are compared with PyTorch's
	$(BIN)/poet mcu run --qemu --model mlp --batch-size 160 --ram-budget 250000 --no-remat --steps 2 \
		--work-dir $(DEMO_DIR)/mcu
	# Flower: a SuperLink and two SuperNodes on loopback (TLS), one FedAvg round with SecAgg+, each node under the
	# schedule for its own RAM budget, then the same app trained plainly; the parameters are compared
	$(BIN)/python -m poet_edge.flower.demo --rounds 1 --nodes 2 --steps 4 --dir $(DEMO_DIR)/flower

# Tests run in parallel, one pytest worker per core (pytest-xdist); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 8 ] && n=8; echo $$n)

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-fast: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

lint: setup
	$(BIN)/ruff check poet_edge host device_agent tests bench

bench: setup
	$(BIN)/python bench/solver.py

clean:
	rm -rf out .pytest_cache .ruff_cache
