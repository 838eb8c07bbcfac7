#!/usr/bin/env bash
# Measure the InternVL presets' units on this GPU (one layer of each kind, bf16) and print them
# beside the analytic cost model; then train the tiny model briefly on the GPU path (NCCL, bf16).
#
#   scripts/profile_gpu.sh OUT_DIR [DEVICE_PRESET]      # e.g. OUT_DIR=profiles, h200-141g
#
# Shape: a group of 9 tiles and 4096 LLM tokens in 4 packed samples of 1024 (the reference group of
# the partition notes). Writes OUT_DIR/<preset>.json (CostTable profiles: the trainer's
# --omnibal-profile reads them, cost_model.calibrated_costs fits rates from them) and
# OUT_DIR/gpu_train.jsonl. profiles/h200 holds what it measured on an H200.
set -uo pipefail
out="${1:?usage: scripts/profile_gpu.sh OUT_DIR [DEVICE_PRESET]}"
preset="${2:-h200-141g}"
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0
for model in internvl-6b-20b internvl-6b-34b; do
  python -m omnibal_cli profile --json "$out/$model.json" --compare-device "$preset" \
    --model "$model" --bf16 --device cuda --tiles 9 --llm-tokens 4096 --sample-tokens 1024 || status=1
done
torchrun --nproc-per-node 1 "${here}/pretrain_vlm.py" --device cuda --bf16 --train-iters 60 \
  --eval-interval 60 --omnibal-isf --omnibal-recompute auto --log-interval 10 \
  --json-log "$out/gpu_train.jsonl" || status=1
exit $status
