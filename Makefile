# The two commands of the README: `make demo` (the demo service) and `make test` (the suite).
# Both create .venv and install what they need; torch is pinned by constraints.txt in every
# install path (an unpinned torch pulls multi-GB CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-slow lint typecheck proto install trainer-venv peer-venv validate-deploy image base-images compose-test

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[service,dev]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# A second venv with verl and the OLDEST transformers the `trainer` extra accepts: the parity
# tests marked `verl` run a trainer there against a service here (they skip without it).
trainer-venv:
	scripts/trainer_venv.sh

# The optional `peer` extra (ray[serve]) in .venv, for `oldlogit bench peer`'s Ray Serve peer;
# `make install` and CI leave it out (the suite measures oldlogit and naive without it).
peer-venv: $(STAMP)
	$(PIP) install -q -c constraints.txt -e ".[service,dev,peer]"

demo: $(STAMP)
	$(VENV)/bin/oldlogit serve --demo --snapshot-dir ./snapshots/demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The tests `make test` leaves out (marked `slow`: benchmark and example smokes, runs with
# servers of their own that kill, restart or cut them off, the compose/image/TLS command
# lines, larger budgets and further dtypes, profiles and rank counts of the matrices), on
# their own. Same PYTEST_ARGS.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

LINTED := $(wildcard client service tests benchmarks examples scripts)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/lint-imports  # the import contracts in pyproject.toml: client ↛ service, no cycles

typecheck: $(STAMP)
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# The deploy files, checked statically (no Docker engine or cluster here): hadolint on the
# Dockerfile, the compose-spec schema on docker-compose.yml, and each kustomize overlay built
# and validated against the pinned Kubernetes version. tests/e2e/test_deploy_static.py runs
# the same checks and also runs every command the files contain against local servers.
K8S_VERSION = $(shell cat deploy/k8s/KUBERNETES_VERSION)

validate-deploy: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	mkdir -p test-artifacts
	set -e; for overlay in deploy/k8s/overlays/*/; do \
	  out=test-artifacts/k8s-$$(basename $$overlay).yaml; \
	  $(VENV)/bin/kubectl kustomize $$overlay > $$out; \
	  $(VENV)/bin/kubernetes-validate --strict --kubernetes-version $(K8S_VERSION) $$out; \
	done

# The image, built with Docker (scripts/build_image.sh says what each variable does). Plain
# `make image` on a machine with registry access is `docker build .`; `make image VARIANT=cuda`
# the CUDA build. Behind a TLS-intercepting proxy or without an image registry it hands the
# build the CA bundle ($$PIP_CERT), a local torch wheel and a local Debian base.
image:
	scripts/build_image.sh

# Local Debian base images (python, redis) for hosts with no image registry.
base-images:
	scripts/make_base_images.sh

# The whole docker-compose.yml brought up and checked as a user would, then torn down
# (scripts/compose_test.py). Needs a Docker engine; not part of `make test`, .ci/run calls it.
compose-test: $(STAMP)
	$(PY) scripts/compose_test.py $(COMPOSE_TEST_ARGS)
