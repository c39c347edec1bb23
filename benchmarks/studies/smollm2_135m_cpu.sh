#!/usr/bin/env bash
# Real CPU runs behind reports/eval/smollm2_135m.md (SmolLM2-135M, BF16 vs QuaRot-INT2 vs OSCAR):
#   bash benchmarks/studies/smollm2_135m_cpu.sh     (any working directory; PYTHON= picks the interpreter)
# Results land under results/ (eval and fidelity cells); the report's tables are copied from them.
# Small limits: a 2-core machine shared with other jobs. BF16 windows shrunk to sink=16, recent=64 so
# that short prompts actually read the INT2 cache (defaults 64/256 would leave MMLU prompts untouched).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root (this file is benchmarks/studies/<name>.sh)
W="method.sink=16 method.recent=64"
PY=${PYTHON:-python3}
for m in quarot oscar; do
  $PY -m oscar fidelity model=smollm2-135m method=$m $W windows=2 seq_len=512 modes=decode_equivalent threads=2 progress=false
done
for m in bf16 quarot oscar; do
  $PY -m oscar eval model=smollm2-135m method=$m benchmark=mmlu benchmark.limit=30 \
      benchmark.extra.score_mode=decode_equivalent $W seed=0 threads=2 progress=false
done
for m in quarot oscar; do
  $PY -m oscar fidelity model=smollm2-135m method=$m $W windows=1 seq_len=512 prefill=496 modes=serving \
      attention=false threads=2 progress=false output=results/fidelity/smollm2-135m/$m/paul_graham-serving
done
# out-of-domain text (Debian jargon file; calibration used the essays)
for m in quarot oscar; do
  $PY -m oscar fidelity model=smollm2-135m method=$m $W corpus=jargon windows=2 seq_len=512 modes=decode_equivalent \
      threads=2 progress=false
done
# a small generation cell: NIAH at 512 tokens (4 items, greedy, 12 new tokens)
for m in bf16 quarot oscar; do
  $PY -m oscar eval model=smollm2-135m method=$m benchmark=niah benchmark.context_lengths=[512] \
      benchmark.extra.samples_per_length=4 benchmark.batch_size=4 benchmark.max_new_tokens=12 $W seed=0 threads=2 progress=false
done
