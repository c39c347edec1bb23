#!/bin/bash
cd /work/main
while pgrep -f "oscar calibrate model=qwen2.5-coder-0.5b method=auto results_dir=results/h4" > /dev/null; do sleep 10; done
test -f results/s12/cal/essays-kl/qwen2.5-coder-0.5b/auto/meta.json || { echo "no artifact"; exit 1; }
exec nice -n 10 python -m oscar eval threads=2 model=qwen2.5-coder-0.5b method=auto method.sink=16 method.recent=64 \
  benchmark=humaneval benchmark.limit=164 benchmark.max_new_tokens=384 benchmark.temperature=0.0 benchmark.batch_size=64 \
  +benchmark.extra.continuous=true +benchmark.extra.answer_start=function "+benchmark.extra.stop=['\`\`\`']" seed=0 \
  artifacts_dir=results/s12/cal/essays-kl results_dir=results/s12 device=cpu tracking.enabled=false progress=false \
  output=results/s12/eval/qwen2.5-coder-0.5b/auto+essays-kl/humaneval/seed0
