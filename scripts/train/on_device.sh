#!/usr/bin/env bash
# One device call of a training stage; the return limits (8 files, 16 MiB each) shape the packing.
#   run(command="ARGS='--steps 327 --single-episode' bash scripts/train/on_device.sh",
#       carry=["build/stdlib-data"])   # plus the --init-from folder for stages 2-4
# fla 0.6's backward refuses Triton < 3.7.1 on Hopper (wrong gradients, its issue #640), so the
# stages ran transformers' torch chunked delta rule (--no-fla).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
# shellcheck disable=SC2086
python3 scripts/train/train.py --data build/stdlib-data --out "$OUT" --no-fla ${ARGS:-} 2>&1 \
    | grep -v "^\[transformers\]" | tee "$OUT/log.txt"
cd "$OUT/stdlib-19m" || exit 1
split -b 15M model.safetensors model.safetensors.part-  # joined here with cat
rm -f model.safetensors tokenizer.json tokenizer_config.json chat_template.jinja manifest.json \
    tokenizer_report.json
ls -la
