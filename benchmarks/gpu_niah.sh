#!/usr/bin/env bash
# The needle table on one GPU: benchmarks/gpu_eval.sh with TABLE=niah (kept so that earlier records name a script that runs).
TABLE=niah exec bash "$(dirname "$0")/gpu_eval.sh" "$@"
