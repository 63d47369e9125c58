#!/usr/bin/env bash
# The GPU evidence run (issue 4), from a plain checkout: no install step, no network, no flash-attn.
#
#   verify/gpu_matrix.sh [OUT_DIR] [DEVICE]    OUT_DIR: default $OUT; DEVICE: cuda (meta for a dry run)
#
# memcalc verify --matrix (every trick set) for the llama family at Qwen3-8B width (hidden 4096,
# 32 heads, 8 KV heads, FFN 12288, vocab 151936) and the gpt family (the textbook layer) at hidden
# 4096, 32 heads, 36 layers, each at seq 8192 and at 2048 (the s² term's scaling). verify builds
# as many layers as fit. Each run's JSON is written as soon as it ends; each matrix has a time limit
# (LIMIT seconds, default 100) so the whole script ends inside 8 minutes and keeps what finished.
# Everything comes back as at most 4 files: summary.md, results.json, env.txt, logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-verify-results}}
device=${2:-cuda}
limit=${LIMIT:-100}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import torch; print("cuda device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
} > "$work/env.txt" 2>&1

matrix() {  # name, then the model options
  local name=$1
  shift
  timeout "$limit" python3 -m memcalc verify --matrix --device "$device" --steps 2 --no-linearity \
    --format json --save "$work/$name" "$@" > "$work/$name.json" 2> "$work/$name.log"
  echo "$name: exit $? ($(ls "$work/$name" 2>/dev/null | wc -l) runs written)" | tee -a "$work/env.txt"
}

matrix llama-s8192 --model qwen3-8b --seq 8192
matrix gpt-s8192 --layers 36 --hidden 4096 --heads 32 --seq 8192
matrix llama-s2048 --model qwen3-8b --seq 2048
matrix gpt-s2048 --layers 36 --hidden 4096 --heads 32 --seq 2048

cp "$work/env.txt" "$out/env.txt"
tar czf "$out/logs.tgz" -C "$work" .
python3 -m verify.summary "$work" --json "$out/results.json" --markdown "$out/summary.md"
