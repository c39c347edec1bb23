#!/usr/bin/env bash
# Snakemake runs this once inside the fresh conda env of envs/oscar.yaml, from the workflow's
# working directory (the checkout, unless --directory points elsewhere: then set OSCAR_ROOT).
set -euo pipefail
pip install --no-deps -e "${OSCAR_ROOT:-.}"
