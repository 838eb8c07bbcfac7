#!/usr/bin/env bash
# Launch pretrain_vlm.py with torchrun on one or several nodes.
#
#   NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/train.sh --model internvl-6b-20b ...
#
# Every argument is passed to pretrain_vlm.py.  On a CPU-only machine the run uses gloo; with
# GPUs, NCCL (one process per GPU).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun \
  --nproc-per-node "${NPROC_PER_NODE:-2}" \
  --nnodes "${NNODES:-1}" \
  --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  "${here}/pretrain_vlm.py" "$@"
