#!/usr/bin/env bash
# Device calls that check and time everything GPU-side, results under $OUT (carry [".whl"]):
#   DELTASERVE_GIT_COMMIT=<sha> bash scripts/gpu/session.sh check   # tests + parity.py
# (the device's copy of the tree has a stale .git: pass the commit so records name it)
#   bash scripts/gpu/session.sh bench   # bench --device cuda (0.8B, 2B, portable) + batch bench
#   bash scripts/gpu/session.sh tune    # dense GEMV tests + scripts/gpu/gemv_tune.py
#   bash scripts/gpu/session.sh ours    # the 0.8B bench and the batch bench without the peers
#   bash scripts/gpu/session.sh vision  # the MiniCPM-V tower vs transformers, TTFT through serve
#   bash scripts/gpu/session.sh spec    # speculative decoding: tests/spec, then spec_bench.py
#   bash scripts/gpu/session.sh ttft    # short-prefill host cost: scan_tune, ttft_profile, the 4k
#                                       # prefix-cache TTFT, the image question's TTFT via serve
#   bash scripts/gpu/session.sh qgemm   # int8 batch GEMM tests + sweep, then the batched engine
#   bash scripts/gpu/session.sh profile # ttft_profile per source line, prefix TTFT, image TTFT
#   bash scripts/gpu/session.sh final   # every gpu test, batch bench, prefill_syncs.py
#   bash scripts/gpu/session.sh graphs  # tower graph tests, tower bench, image TTFT, prefill cProfile
#   bash scripts/gpu/session.sh prefill # short-prefill graphs: tests, TTFT profile, prefix TTFT, image TTFT
#   bash scripts/gpu/session.sh confirm # the same, shorter, printing the graph-vs-eager errors
#   bash scripts/gpu/session.sh fused   # q1 GEMV, the MLP's GEMV prologues, PDL decode: tests,
#                                       # decode A/B (prologue off / on / on + PDL), q1 tune
#   bash scripts/gpu/session.sh q1      # the q1 GEMV: tests, a quick launch sweep, q1 decode
#   bash scripts/gpu/session.sh capture # issue 6 experiment: a long prefill chunk eager vs replayed
#                                       # from a CUDA graph (prefill_capture.py); q1 decode again
#   bash scripts/gpu/session.sh magic   # the GEMV's byte-permute conversions: tests, chain sweep,
#                                       # a grid barrier's cost (grid_barrier_probe.py), decode tok/s
#   bash scripts/gpu/session.sh persistent  # the layer GEMVs as one persistent kernel vs PDL
#   bash scripts/gpu/session.sh ws      # the same as a warp-specialised CUDA kernel (CuPy)
#   bash scripts/gpu/session.sh tagged  # the PDL chain with tagged-word handoffs (no gdc_wait)
#   bash scripts/gpu/session.sh wide    # wide programs in tile / early PDL mode (qgemv_chain sweeps)
#   bash scripts/gpu/session.sh decode  # decode tok/s of the quantized formats
#   bash scripts/gpu/session.sh magic4  # int4 decode, MAGIC 4 against MAGIC 2 (A/B twice), GEMV tests
#   TEST_PATHS="tests/ops" bash scripts/gpu/session.sh suite  # gpu tests of some paths
#   bash scripts/gpu/session.sh pdl     # PDL on by default: decode all formats, batch bench, then
#                                       # every gpu test (last, under a time limit)
# check: every gpu-marked test (Triton kernels vs their torch references, CUDA graphs vs eager,
#   the Triton backend vs the portable one, CUDA vs CPU), junit XML in $OUT/gpu-tests.xml; then
#   CPU-vs-CUDA greedy tokens (fp32) and bf16-vs-fp32 gate measures, both backends.
# bench: deltaserve bench --device cuda on the 0.8B shape (prefill tiers, decode bf16/int8/int4
#   with roofline %, attribution and the greedy head; transformers + fla as the peer), the 2B shape
#   (decode only), the portable backend (bf16), and the batched engine (bf16 and int8).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
ckpt() { [ -d "$2" ] || python3 -m deltaserve make-checkpoint --preset "$1" --seed 0 "$2" > /dev/null; }
[ "${1:-check}" = vision ] || ckpt qwen3.5-0.8b /tmp/q08
quiet() { grep -v -i "warn" | tail -"$1"; }
prefix_ttft() {  # issue 5: the 4k shared-prefix TTFT, miss vs hit, into $OUT/$1.json
    python3 -c "import json, sys; from pathlib import Path; from deltaserve.bench.worker import \
shared_prefix_ttft as f; r = f(Path('/tmp/q08'), 'bfloat16', 4096, device='cuda'); \
print(json.dumps(r)); Path(sys.argv[1]).write_text(json.dumps(r))" "$OUT/$1.json" 2>&1 | quiet 2
}
image_ttft() {  # issue 8: an image question's TTFT through serve, with the in-process stages
    ckpt minicpm-v-4.6 /tmp/mcv
    python3 scripts/gpu/vision_ttft.py --model /tmp/mcv --device cuda --breakdown \
        --out "$OUT/vision-ttft.json" 2>&1 | quiet "$1"
}
decode_bench() {  # decode tok/s, bf16 / int8 / int4, 128 tokens, into $1
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
        --formats "${FORMATS:-bf16,int8,int4}" --prefill-lens "" --peer none --out "$1" 2>&1 \
        | grep -E "^(decode|roofline)" | cut -c1-200
}
prefill_rates() {  # the bf16 engine's prefill tok/s (medians, then the runs) of a bench record
    python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['engines']['deltaserve-bf16']; \
print(sys.argv[2], {k[8:-6]: round(v) for k, v in e.items() if k.endswith('_tok_s') and \
k.startswith('prefill_') and isinstance(v, float)}, e.get('prefill_8192_runs_tok_s'))" "$1" "$2"
}
case "${1:-check}" in
check)
    python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | tail -25
    python3 scripts/gpu/parity.py --model /tmp/q08 --out "$OUT/parity.json" 2>&1 | quiet 8
    ;;
bench)
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
        --prefill-lens 2048,5120,8192,10240,32768 --kv-cache-dtypes auto,float32,float16 \
        --out "$OUT/bench-cuda.json" 2>&1 | quiet 25
    ckpt qwen3.5-2b /tmp/q2b
    python3 -m deltaserve bench --model /tmp/q2b --device cuda --decode-tokens 128 \
        --prefill-lens 8192 --peer none --out "$OUT/bench-cuda-2b.json" 2>&1 | quiet 12
    DELTASERVE_GPU_BACKEND=portable python3 -m deltaserve bench --model /tmp/q08 --device cuda \
        --decode-tokens 128 --formats bf16 --prefill-lens 2048,8192 --peer none \
        --out "$OUT/bench-cuda-portable.json" 2>&1 | quiet 8
    python3 scripts/gpu/batch_bench.py --int8 --out "$OUT/batch-bench.json" 2>&1 | quiet 6
    ;;
tune)  # the dense 16-bit GEMV: its parity tests, then the per-shape sweep against cuBLAS
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_gemv.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -3
    python3 scripts/gpu/gemv_tune.py --out "$OUT/gemv_tune.json" 2>&1 | grep -v -i warn | tail -40
    ;;
ours)  # our engine only (the peers measured by `bench` earlier the same day), after a few tests
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_conv1d.py tests/ops/test_triton_gemv.py \
        tests/engine/test_cuda_graphs.py --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -3
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 --peer none \
        --prefill-lens 2048,5120,8192,10240,32768 --out "$OUT/bench-cuda.json" 2>&1 | quiet 4
    python3 scripts/gpu/batch_bench.py --int8 --peer-batches none --out "$OUT/batch-bench.json" \
        2>&1 | quiet 6
    ;;
spec)  # issue 9: speculative decoding tests, then tok/s with and without drafts
    python3 -m pytest -q -m "not slow" -p no:cacheprovider tests/spec --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | tail -3
    python3 scripts/gpu/spec_bench.py --out "$OUT/spec-bench.json" 2>&1 | quiet 40
    ;;
vision)  # issue 8: the MiniCPM-V tower vs transformers (bf16, real shape), then TTFT via serve
    python3 -m deltaserve.bench.vision --device cuda --dtype bfloat16 --repeats 20 \
        --out "$OUT/vision-tower.json" 2>&1 | quiet 6
    ckpt minicpm-v-4.6 /tmp/mcv
    python3 scripts/gpu/vision_ttft.py --model /tmp/mcv --device cuda --out "$OUT/vision-ttft.json" \
        2>&1 | quiet 6
    ;;
ttft)
    python3 scripts/gpu/scan_tune.py --lens 40,128,256,4096 \
        --out "$OUT/scan-tune.json" 2>&1 | quiet 30
    python3 scripts/gpu/ttft_profile.py --out "$OUT/ttft-profile.json" 2>&1 | grep -v "^    {" | quiet 6
    prefix_ttft prefix-ttft
    image_ttft 12
    ;;
qgemm)  # issue 6: the int8 decode-batch GEMM (tests, sweep vs cuBLAS), then the batched engine
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_qgemm.py tests/quant \
        tests/engine/test_cuda_graphs.py --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -4
    python3 scripts/gpu/qgemm_tune.py --out "$OUT/qgemm-tune.json" 2>&1 \
        | grep -v -i warn | cut -c1-400 | tail -22
    python3 scripts/gpu/batch_bench.py --int8 --peer-batches none --out "$OUT/batch-bench.json" \
        2>&1 | quiet 6
    ;;
final)  # every gpu test, the int8 batch GEMM's launch rule in the engine, a prefill's syncs
    python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | tail -6
    python3 scripts/gpu/batch_bench.py --int8 --batches 1,8,32,128 --peer-batches none \
        --out "$OUT/batch-bench.json" 2>&1 | quiet 4
    python3 scripts/gpu/prefill_syncs.py --out "$OUT/prefill-syncs.json" 2>&1 | grep -v -i warn \
        | cut -c1-160 | head -120
    ;;
profile)  # issues 5 and 8: where a short prefill's host time goes, per source line
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_norm.py \
        tests/ops/test_triton_gdn_scan.py tests/engine tests/cache tests/models \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -4
    python3 scripts/gpu/ttft_profile.py --stacks --out "$OUT/ttft-profile.json" \
        > "$OUT/ttft-profile.log" 2>&1
    grep -v "^ *{" "$OUT/ttft-profile.log" | grep -v -i warn | head -100 | cut -c1-200
    prefix_ttft prefix-ttft
    image_ttft 12
    ;;
graphs)  # issue 8: the tower's CUDA graphs; where a short prefill's host time goes (cProfile)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/multimodal tests/engine/test_cuda_graphs.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -4
    python3 -m deltaserve.bench.vision --device cuda --dtype bfloat16 --repeats 20 \
        --out "$OUT/vision-tower.json" 2>&1 | quiet 4
    image_ttft 14
    python3 scripts/gpu/ttft_profile.py --cprofile --out "$OUT/ttft-profile.json" \
        > "$OUT/ttft-profile.log" 2>&1
    grep -v -i warn "$OUT/ttft-profile.log" | grep -v "^ *{" | head -20 | cut -c1-200
    ;;
prefill)  # issues 5 and 8: short prefill chunks replayed from CUDA graphs
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine tests/multimodal tests/models \
        tests/cache tests/spec --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -6
    python3 scripts/gpu/ttft_profile.py --out "$OUT/ttft-profile.json" > "$OUT/ttft-profile.log" 2>&1
    grep -E "^(hit|fresh)" "$OUT/ttft-profile.log"
    prefix_ttft prefix-ttft-1; prefix_ttft prefix-ttft-2
    image_ttft 8
    [ -n "${BENCH:-}" ] && python3 -m deltaserve bench --model /tmp/q08 --device cuda \
        --decode-tokens 128 --prefill-lens 2048,8192 --formats bf16 --peer none \
        --out "$OUT/bench-cuda.json" 2>&1 | quiet 12
    ;;
confirm)  # issues 5 and 8, last look: graph tests (with their errors), TTFTs
    python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine tests/multimodal tests/models \
        tests/cache tests/spec --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "rel|passed|failed|Error" | tail -20
    python3 scripts/gpu/ttft_profile.py --out "$OUT/ttft-profile.json" > "$OUT/ttft-profile.log" 2>&1
    grep -E "^(hit|fresh)" "$OUT/ttft-profile.log"
    prefix_ttft prefix-ttft
    image_ttft 8
    ;;
fused)  # issues 4 and 6: q1 GEMV, the MLP as two GEMVs, programmatic dependent launch
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/engine/test_cuda_graphs.py \
        tests/quant --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
    DELTASERVE_PDL=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_gemv_prologue.py \
        tests/engine/test_cuda_graphs.py tests/ops/test_triton_attention.py \
        tests/ops/test_triton_gdn_decode.py tests/ops/test_triton_norm.py tests/ops/test_triton_head.py \
        --junitxml="$OUT/gpu-tests-pdl.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
    for ab in "0 0 bf16,int8" "1 0 bf16,int8,int4,q1" "1 1 bf16,int8,int4,q1"; do
        set -- $ab
        DELTASERVE_GEMV_PROLOGUE=$1 DELTASERVE_PDL=$2 python3 -m deltaserve bench --model /tmp/q08 \
            --device cuda --decode-tokens 128 --formats "$3" --prefill-lens 2048 --peer none \
            --out "$OUT/bench-prologue$1-pdl$2.json" 2>&1 | grep -v -i warn | grep -E "decode|tok_s" | cut -c1-300 | tail -8
    done
    timeout 150 python3 scripts/gpu/qgemv_tune.py --formats q1 --out "$OUT/qgemv-tune-q1.json" 2>&1 \
        | grep -v -i warn | cut -c1-300 | tail -9
    ;;
pdl)  # issues 4 and 6, after fused: PDL on by default, the q1 GEMV reading x once
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
        --formats bf16,int8,int4,q1 --prefill-lens 2048,8192 --peer none \
        --out "$OUT/bench-cuda.json" 2>&1 | grep -E "^(decode|prefill|roofline)" | cut -c1-200
    python3 scripts/gpu/batch_bench.py --int8 --batches 1,32,128 --peer-batches none \
        --out "$OUT/batch-bench.json" 2>&1 | quiet 4
    timeout "${TESTS_S:-330}" python3 -m pytest -q -m gpu tests -p no:cacheprovider \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
    ;;
q1)  # issue 4: the q1 GEMV (bit sums per word first), a quick launch sweep, then q1 decode
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_qgemv.py \
        tests/ops/test_gemv_prologue.py tests/ops/test_triton_head.py -k q1 \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -6
    DELTASERVE_PDL=0 timeout 240 python3 scripts/gpu/qgemv_tune.py --formats q1 --quick \
        --shapes 6144x1024,1024x3584,248320x1024 --out "$OUT/qgemv-tune-q1.json" 2>&1 \
        | grep -v -i warn | cut -c1-260 | tail -5
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 --formats q1 \
        --prefill-lens "" --peer none --out "$OUT/bench-q1.json" 2>&1 \
        | grep -E "^(decode|roofline)" | cut -c1-200
    ;;
persistent)  # issue 4: the model's 96 layer GEMVs as one persistent kernel with grid barriers,
    # the next GEMV's tile prefetched into registers before each barrier, against the engine's
    # PDL chain in the same run (scripts/gpu/persistent_chain.py; PC_ARGS: its options)
    timeout "${PC_S:-420}" python3 scripts/gpu/persistent_chain.py ${PC_ARGS:-} \
        --out "$OUT/persistent-chain.json" 2>&1 | grep -v -i warn | cut -c1-600 | tail -40
    ;;
tagged)  # issue 4: the engine's PDL chain of GEMV kernels with a tagged-word handoff instead of
    # griddepcontrol.wait (scripts/gpu/tagged_chain.py), then the ws kernel's configs (WS_ARGS)
    timeout "${TG_S:-240}" python3 scripts/gpu/tagged_chain.py --out "$OUT/tagged-chain.json" \
        2>&1 | grep -v -i warn | cut -c1-600 | tail -20
    ;;
ws)  # issue 4: the layer GEMVs as one warp-specialised persistent CUDA kernel (a producer warp
    # streams weights into a shared-memory ring; scripts/gpu/ws_chain.py, CuPy's NVRTC) vs PDL
    timeout "${WS_S:-300}" python3 scripts/gpu/ws_chain.py ${WS_ARGS:-} --out "$OUT/ws-chain.json" \
        2>&1 | grep -v -i warn | cut -c1-600 | tail -40
    ;;
magic)  # issue 4: the quantized GEMV's byte-permute conversions (MAGIC 2): parity tests, then
    # per-shape and model chains with the tile-mode sweep over launch shapes x conversions
    # (CHAIN_ARGS: qgemv_chain.py's options; PROBE=0 / DECODE=0 skip the barrier probe / decode;
    # all of it can pass the device's 600 s per call: shorten CHAIN_S or skip parts)
    timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_qgemv.py \
        tests/ops/test_triton_qgemv_pdl.py --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout "${CHAIN_S:-300}" python3 scripts/gpu/qgemv_chain.py --sweep --jobs 14 \
        ${CHAIN_ARGS:---variants nopdl,tile,early} --out "$OUT/qgemv-chain.json" 2>&1 \
        | grep -v -i warn | grep -E "^(==|  )|copy_gbs|compiled" | cut -c1-400 | tail -40
    if [ "${PROBE:-1}" = 1 ]; then
        timeout 60 python3 scripts/gpu/grid_barrier_probe.py --out "$OUT/grid-barrier.json" 2>&1 \
            | tail -6
    fi
    if [ "${DECODE:-1}" = 1 ]; then decode_bench "$OUT/bench-decode.json"; fi
    ;;
wide)  # issue 4: wide programs (up to 64 rows, 16 warps: every program resident, all preloading)
    # swept in tile and in early PDL mode (MAGIC 2), model chain and per-shape chains
    for mode in tile early; do
        timeout 170 python3 scripts/gpu/qgemv_chain.py --sweep --jobs 14 --variants nopdl,engine \
            --magic 2 --sweep-pdl $mode --sweep-shapes 8:8,16:4,16:8,16:16,32:8,32:16,64:8,64:16 \
            --out "$OUT/qgemv-chain-$mode.json" 2>&1 | grep -v -i warn \
            | grep -E "^(==|  (engine|tuned) )|copy_gbs" | cut -c1-300 | tail -12
    done
    ;;
decode)  # issue 4: decode tok/s of the quantized formats (the GEMV's launch tables as committed)
    decode_bench "$OUT/bench-decode.json"
    ;;
magic4)  # issue 4: int4 decode with TUNED_PDL's MAGIC 4 entries against the same table at MAGIC 2
    # (this copy of the tree edited in place between runs; A/B $REPS times, default 2; BEFORE: the
    # sed expression that makes the "before" tree; AB_FORMATS, default int4; CONTROL: formats
    # timed once after, default bf16,int8, empty for none), then the GEMV gpu tests
    T=deltaserve/ops/triton_qgemv.py
    cp $T /tmp/triton_qgemv.orig
    for i in $(seq "${REPS:-2}"); do
        sed -i "${BEFORE:-s/, 1, 4),  # /, 1, 2),  # /}" $T
        FORMATS=${AB_FORMATS:-int4} decode_bench "$OUT/bench-before-$i.json"
        cp /tmp/triton_qgemv.orig $T
        FORMATS=${AB_FORMATS:-int4} decode_bench "$OUT/bench-after-$i.json"
    done
    if [ -n "${CONTROL-bf16,int8}" ]; then
        FORMATS=${CONTROL-bf16,int8} decode_bench "$OUT/bench-decode-control.json"
    fi
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_qgemv.py \
        tests/ops/test_triton_qgemv_pdl.py tests/ops/test_gemv_prologue.py \
        tests/ops/test_triton_head.py tests/quant/test_quantized_cuda.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | grep -E "passed|failed|FAILED|Error" | tail -12
    ;;
suite)  # gpu tests of $TEST_PATHS (default: all) under ${TESTS_S:-480} s, junit XML; decode first
    # when DECODE=1 (a run cut by the limit writes no XML; the -v log keeps what ran)
    if [ "${DECODE:-0}" = 1 ]; then decode_bench "$OUT/bench-decode.json"; fi
    timeout "${TESTS_S:-480}" python3 -m pytest -v -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} \
        --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
    grep -cE " PASSED" "$OUT/gpu-tests.log"; grep -E " (FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" \
        | tail -15
    ;;
why)  # issue 6: what stops the capture (first sync inside forward_batch), cProfile of generate
    timeout 200 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 8192 --why \
        --out "$OUT/prefill-why.json" 2>&1 | grep -v -i warn | cut -c1-700 | tail -45
    ;;
next)  # issue 6, next session: this session's unmeasured code (snapshot-keeping long graphs, the
    # review's test changes), the split-attention probe, prefix-on prefill with snapshot graphs off/on
    timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_prefill_graph.py \
        tests/ops/test_triton_conv1d.py tests/ops/test_triton_act.py tests/ops/test_triton_norm.py \
        tests/ops/test_gemv_prologue.py --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | grep -E "passed|failed|FAILED|Error|rel" | tail -14
    timeout 120 python3 scripts/gpu/attention_split_probe.py --out "$OUT/split-probe.json" 2>&1 \
        | grep -v -i warn | cut -c1-300 | tail -4
    for snaps in 0 1; do
        DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=$snaps timeout 100 python3 scripts/gpu/prefill_capture.py \
            --model /tmp/q08 --lens 2048,8192 --prefix-on --out "$OUT/prefix-on-snaps$snaps.json" \
            2>&1 | grep -v -i warn | cut -c1-200 | tail -2
    done
    ;;
last)  # the tenth session's last call: every gpu test (speculation on CUDA printed), the bench tiers
    timeout "${TESTS_S:-300}" python3 -m pytest -q -s -m gpu tests -p no:cacheprovider \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error|identical" | tail -14
    timeout 150 python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 \
        --formats bf16,int8 --peer none --prefill-lens 2048,8192,32768 \
        --out "$OUT/bench-cuda.json" 2>&1 | grep -E "^(decode|prefill|roofline)" | cut -c1-200
    prefill_rates "$OUT/bench-cuda.json" "last"
    ;;
defaults)  # issue 6: long prompts with LLM's defaults (8192-token chunks on CUDA) vs 2048 chunks
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_prefill_graph.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
    for chunk in default 2048; do
        timeout 150 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192,32768 \
            --prefix-on $( [ $chunk = default ] || echo --chunk $chunk ) --repeats 3 \
            --out "$OUT/prefix-on-chunk-$chunk.json" 2>&1 | grep -v -i warn | cut -c1-220 | tail -3
    done
    ;;
sparse)  # issue 6: the default (sparse) prefix snapshots and the split attention, as users run them
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_prefill_graph.py \
        tests/ops/test_conv1d_attention.py tests/engine/test_cuda_graphs.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
    timeout 120 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192,32768 \
        --prefix-on --out "$OUT/prefix-on-sparse.json" 2>&1 | grep -v -i warn | cut -c1-200 | tail -3
    timeout 150 python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 16 \
        --formats bf16 --peer none --prefill-lens 2048,5120,8192,10240,32768 \
        --out "$OUT/bench-prefill.json" > /dev/null 2>&1
    prefill_rates "$OUT/bench-prefill.json" "prefix off, graphs + split"
    prefix_ttft prefix-ttft
    ;;
split)  # issue 6: the cuDNN split attention: its test, first-call cost per shape, the engine with it
    timeout 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/ops/test_conv1d_attention.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error|rel" | tail -6
    timeout 120 python3 scripts/gpu/attention_split_probe.py --out "$OUT/split-probe.json" 2>&1 \
        | grep -v -i warn | cut -c1-400 | tail -5
    for on in 1 0; do
        DELTASERVE_SPLIT_ATTENTION=$on timeout -s ABRT 150 python3 -X faulthandler -m deltaserve \
            bench --model /tmp/q08 --device cuda --decode-tokens 16 --formats bf16 --peer none \
            --prefill-lens 2048,10240,32768 --out "$OUT/bench-split$on.json" > "$OUT/bench-split$on.log" 2>&1
        echo "split=$on rc=$?"; grep -v -i warn "$OUT/bench-split$on.log" | grep -A30 -E "^(Fatal|Thread|Current)" | head -40
        prefill_rates "$OUT/bench-split$on.json" "split=$on"
    done
    ;;
eager)  # issue 6: new kernels' tests; why the eager prefill got slower (fla's disk cache A/B, cProfile)
    timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_conv1d.py \
        tests/ops/test_conv1d_attention.py tests/ops/test_triton_norm.py tests/ops/test_triton_act.py \
        tests/ops/test_gdn_prefill.py tests/engine/test_prefill_graph.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error|rel per step" | tail -14
    for ab in "1 a" "0 b"; do
        set -- $ab
        FLA_CACHE_RESULTS=$1 DELTASERVE_PREFILL_GRAPH_TOKENS=0 timeout 100 python3 -m deltaserve bench \
            --model /tmp/q08 --device cuda --decode-tokens 16 --formats bf16 --peer none \
            --prefill-lens 2048,8192 --out "$OUT/bench-eager-$2.json" > /dev/null 2>&1
        prefill_rates "$OUT/bench-eager-$2.json" "eager FLA_CACHE_RESULTS=$1"
    done
    DELTASERVE_PREFILL_GRAPH_TOKENS=0 timeout 100 python3 scripts/gpu/prefill_capture.py \
        --model /tmp/q08 --lens 2048 --why --out "$OUT/prefill-why.json" 2>&1 | grep -v -i warn \
        | cut -c1-180 | tail -34
    ;;
graphs8k)  # issue 6: long fresh prefill graphs, lower-right flash, fla tuned at the chunk length
    for ab in "16384 a" "0 b"; do
        set -- $ab
        DELTASERVE_PREFILL_GRAPH_TOKENS=$1 timeout 170 python3 -m deltaserve bench --model /tmp/q08 \
            --device cuda --decode-tokens 16 --formats bf16 --peer none \
            --prefill-lens "$( [ "$2" = a ] && echo 2048,5120,8192,10240,32768 || echo 2048,8192,32768 )" \
            --out "$OUT/bench-$2.json" > /dev/null 2>&1
        prefill_rates "$OUT/bench-$2.json" "graph<=$1"
    done
    timeout 90 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 8192 --kernels \
        --out "$OUT/prefill-kernels.json" 2>&1 | grep -v -i warn | cut -c1-160 | tail -20
    timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/test_triton_conv1d.py tests/ops/test_conv1d_attention.py tests/ops/test_triton_norm.py \
        tests/ops/test_triton_act.py tests/ops/test_gdn_prefill.py tests/engine/test_prefill_graph.py \
        tests/ops/test_gemv_prologue.py tests/engine/test_cuda_graphs.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error|rel per step" | tail -14
    ;;
long)  # issue 6: the tests changed last, the 8k forward's kernels, capture at HEAD, prefill tiers
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_gemv_prologue.py \
        tests/engine/test_cuda_graphs.py tests/cache tests/engine/test_prefill_graph.py \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 120 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 8192 --kernels \
        --out "$OUT/prefill-kernels.json" 2>&1 | grep -v -i warn | cut -c1-200 | tail -48
    timeout 150 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192 \
        --out "$OUT/prefill-capture.json" 2>&1 | grep -v -i warn | cut -c1-400 | tail -6
    ;;
capture)  # issue 6: how fast is a long prefill without host work; issue 4: q1 with its TUNED shapes
    timeout 200 python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192 \
        --out "$OUT/prefill-capture.json" 2>&1 | grep -v -i warn | cut -c1-400 | tail -6
    python3 -m deltaserve bench --model /tmp/q08 --device cuda --decode-tokens 128 --formats q1 \
        --prefill-lens "" --peer none --out "$OUT/bench-q1.json" 2>&1 \
        | grep -E "^(decode|roofline)" | cut -c1-200
    ;;
esac
