#!/bin/bash
cd /work/main
A="model=qwen2.5-coder-0.5b benchmark=niah benchmark.context_lengths=[4096,8192] benchmark.extra.samples_per_length=32 benchmark.max_new_tokens=12 +benchmark.extra.shared_prefill=true seed=0"
T="device=cpu tracking.enabled=false results_dir=results/s11n"
O=results/s11n/eval/qwen2.5-coder-0.5b
exec nice -n 10 python -m oscar eval-shared threads=2 \
  $A method=bf16 method.sink=16 method.recent=64 $T output=$O/bf16/niah/seed0 -- \
  $A method=kivi2 method.sink=0 method.recent=64 $T output=$O/kivi2/niah/seed0 -- \
  $A method=auto method.sink=16 method.recent=64 artifacts_dir=.dev/s11/cal/essays $T output=$O/auto/niah/seed0 -- \
  $A method=auto method.channel_block=32 calibration=code method.sink=0 method.recent=64 artifacts_dir=.dev/s11/cal/cb32-code $T output=$O/auto+cb32-code@0x64/niah/seed0
