#!/usr/bin/env bash
# One device call: install carried wheels, check fla against the torch path, train, pack for return.
#   run(command="bash scripts/train/on_device.sh", carry=[".whl", "build/stdlib-data"])
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/fla_core-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
LOG=$OUT/log.txt
STEPS=${STEPS:-1000}
LIMIT=${LIMIT:-360}
nvidia-smi --query-gpu=name,memory.used --format=csv | tee -a "$LOG"
# same seed, same first batch: the step-0 loss of both kernels must agree
for flag in --no-fla ""; do
    python3 scripts/train/train.py --data build/stdlib-data --out /tmp/check $flag --steps 1 \
        --batch 2 --seq-len 2048 --eval-every 1 2>&1 | grep -E '^\{"(kernel|step)' | head -2 | tee -a "$LOG"
done
python3 scripts/train/train.py --data build/stdlib-data --out "$OUT" --steps "$STEPS" \
    --time-limit-s "$LIMIT" 2>&1 | grep -v "^\[transformers\]" | tee -a "$LOG"
cd "$OUT/stdlib-19m" || exit 1
split -b 15M model.safetensors model.safetensors.part-
rm -f model.safetensors tokenizer.json tokenizer_config.json chat_template.jinja manifest.json \
    tokenizer_report.json
ls -la
