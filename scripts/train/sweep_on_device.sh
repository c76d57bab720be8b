#!/usr/bin/env bash
# Several training variants at once on one GPU (each is launch-bound, so they share it well); the
# one that retrieves best, then has the lowest held-out loss, comes back split for the return limits.
#   run(command="SWEEP=scripts/train/sweep_v2.txt COMMON='...' bash scripts/train/sweep_on_device.sh",
#       carry=["build/stdlib-data"])
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
COMMON=${COMMON:-}
mkdir -p "$OUT/runs"
pids=()
while read -r name flags; do
    case "$name" in ''|\#*) continue ;; esac
    mkdir -p "$OUT/runs/$name"
    # shellcheck disable=SC2086
    python3 scripts/train/train.py --data build/stdlib-data --out "$OUT/runs/$name" --no-fla \
        $COMMON $flags > "$OUT/runs/$name/log.txt" 2>&1 &
    pids+=($!)
done < "$SWEEP"
wait "${pids[@]}"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts/train")
from train import selection_key
out = Path(sys.argv[1])
summary = {}
for run in sorted((out / "runs").iterdir()):
    log_path = run / "stdlib-19m" / "train_log.json"
    if not log_path.exists():
        summary[run.name] = {"error": (run / "log.txt").read_text()[-3000:]}
        continue
    log = json.loads(log_path.read_text())
    summary[run.name] = {"best": log["best"], "evals": log["evals"], "args": log["args"],
                         "tokens_per_s": log["tokens_per_s"], "fitted": log.get("fitted")}
ok = {k: v for k, v in summary.items() if "best" in v}
winner = max(ok, key=lambda k: selection_key(ok[k]["best"])) if ok else None
summary["winner"] = winner
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v.get("best", v.get("error", "")[-500:]) if isinstance(v, dict) else v
                  for k, v in summary.items()}, indent=1))
if winner:
    (out / "winner.txt").write_text(winner)
PY
[ -f "$OUT/winner.txt" ] || exit 1
W=$(cat "$OUT/winner.txt")
cd "$OUT/runs/$W/stdlib-19m" && split -b 15M model.safetensors "$OUT/model.safetensors.part-"
cd "$OUT" && find runs -name model.safetensors -delete && find runs \( -name tokenizer.json \
    -o -name manifest.json -o -name tokenizer_report.json -o -name chat_template.jinja \
    -o -name tokenizer_config.json \) -delete && tar czf small.tar.gz runs && rm -rf runs
ls -la "$OUT"
