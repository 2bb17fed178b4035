# Two commands for a new user: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0 is installed only when the venv has no torch yet (a GPU user installs the CUDA build first).
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test lint bench clean browser isa-check

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# torch's version is read from its metadata: importing torch before numpy is installed warns "Failed to initialize NumPy"
	@$(BIN)/python -c "import importlib.util as u; exit(u.find_spec('torch') is None)" || $(BIN)/pip install -q "$(TORCH_PIN)"
	@# constrain torch to the installed build so no dependency can pull another release
	@$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/scaletrain demo

# The report's browser tests need Debian's chromium (driven by Playwright's Python package, never `playwright
# install`); as root it is installed here. Under CI (CI=true) a machine without it fails here: the browser tests would
# otherwise be skipped, and a skip is not a pass (tests/conftest.py). Elsewhere they skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  { [ "$$CI" = true ] && echo "error: chromium could not be installed; the browser tests cannot run under CI" >&2 \
	    && exit 1; echo "warning: chromium is not installed; the browser tests will be skipped"; }

# -rs: every skipped test is listed with its reason; under CI only tests marked gpu may skip (tests/conftest.py)
test: $(STAMP) browser
	$(BIN)/python -m pytest tests -rs --durations=30

# ruff, and the import contracts of pyproject.toml (layers, torch-free modules, no cycles; docs/architecture.md)
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# The low-precision MoE layouts of the matrix under torch's default, avx2 and this CPU's own kernels: PASS/FAIL and the
# worst ratio of a difference to its bound per kernel set (docs/verify.md, "On other CPUs"; ~20 min on 2 busy cores)
isa-check: $(STAMP)
	nice -n 10 $(BIN)/python benchmarks/isa_check.py --out isa_check

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs
