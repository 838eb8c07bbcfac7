#!/usr/bin/env bash
# Download, here, the wheels a bare device machine (Python 3.12, PyTorch 2.11, no network) lacks, into
# .whl/ (git-ignored; never commit wheels).  Its image already holds every other package the project
# imports (einops, numpy, pillow, scikit-learn, matplotlib, tqdm, psutil, packaging: see
# /work/.library/device/KINDS.md), so the list is megatron-core (a cp312 manylinux wheel: it carries a
# compiled dataset helper, so it is not pure Python; its own needs torch, numpy, packaging are there),
# xxhash (checkpoint checksums) and flash-linear-attention's kernels, fla-core (pure Python: Triton kernels; its
# needs einops and triton are there; the Gated DeltaNet imports fla.ops.gated_delta_rule from it, and
# gpu_check.py's fla_delta_rule compares it with our torch delta rule), with its umbrella package
# flash-linear-attention (fla's layers and models, for transformers >= 5.6.2).
#
#   scripts/fetch_gpu_wheels.sh        then carry .whl and run scripts/gpu_check.sh there
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl megatron-core==0.16.1 xxhash==4.1.0 fla-core==0.6.0 flash-linear-attention==0.6.0
ls -l .whl
