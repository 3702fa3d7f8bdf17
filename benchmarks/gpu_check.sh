#!/usr/bin/env bash
# GPU bring-up and measurements, in one call on a lent CUDA machine (the device tool);
# builds nothing. Uses that machine's own python3 (CUDA torch, transformers, pyarrow,
# pytest) with this checkout on PYTHONPATH. Every section runs under its own `timeout`,
# capped by what is left of GPU_CHECK_BUDGET_S (default 455 s: with the 10 s kill grace
# and the final line, the call ends within 8 minutes); a section with too little time
# left is skipped, a failed one recorded, and the script goes on. Sections, most
# valuable first (cap in seconds):
#   env          versions, devices, free /dev/shm and /tmp                          30
#   cuda_tests   pytest -m gpu: pinned and CUDA-IPC rings, flex_attention vs the
#                dense mask                                                         70
#   target  (2a) random Qwen3-8B-shaped bf16 target built on cuda:0,
#                TargetModel.hidden on 8 x 2048 tokens: tokens/s, TFLOP/s, MFU;
#                then saved to /tmp/gpu-q8 for 2c                                   90
#   drafter (2b) 5-layer drafter train step (batch_loss + backward, fp32 master
#                weights) on 8 x 2048 tokens, 512 anchors, block 16, per
#                compute_dtype (auto = bf16 autocast, float32): tokens/s, TFLOP/s,
#                MFU (beside SpecForge's ~44%), peak memory                         120
#   pipe_*  (2c) launch.py 1-1 on cuda:0 with that target, 10 optimizer steps:
#                pipelined_cuda, lockstep_cuda, pipelined_host (feature transport);
#                steady tokens/s and stage MFUs; each gets an equal share of what
#                is left, at most                                                   150
#   tiny    (3)  tiny default target 2-2 on cuda:0 against the single-process
#                reference (equal within tolerance, not bits), and the monitor's
#                view: GPU memory per actor, stage MFU                               90
#   nodes   (3)  two nodes on loopback, each 1-1 on cuda:0, gradient chain over
#                gloo (NCCL refuses two ranks on one GPU): identical replicas        70
#   serving      prepare --server against a real vLLM serving the tiny chat target,
#                when vLLM is installed (skipped otherwise): path, rows, tokens/s   100
# Logs and one JSON file per section go to $OUT; the last line printed (also
# $OUT/gpu_check.json) is {"check": "gpu_check", ..., "failed": [...]}.
# Without a GPU, GPU_CHECK_SMOKE=1 GPU_CHECK_PYTHON=.venv/bin/python runs the same
# sections on CPU with tiny shapes (gpu_bench --smoke), to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
export OUT
mkdir -p "$OUT"
BUDGET_S=${GPU_CHECK_BUDGET_S:-455}
PY=${GPU_CHECK_PYTHON:-python3}
STARTED=$(date +%s)
: > "$OUT/sections.tsv"

left() { echo $((BUDGET_S - ($(date +%s) - STARTED))); }

# section NAME CAP MIN CMD...: CMD under `timeout` for min(CAP, time left) seconds
# (SECTION_S tells it how long it has), output in $OUT/NAME.log; skipped when fewer
# than MIN seconds are left. Appends "NAME<TAB>exit code or skipped<TAB>seconds".
section() {
  local name=$1 cap=$2 min=$3 t rc t0
  shift 3
  t=$(left)
  (( t > cap )) && t=$cap
  if (( t < min )); then
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/sections.tsv"
    echo "== $name: skipped (${t}s for it, needs ${min}s)"
    return
  fi
  echo "== $name (up to ${t}s)"
  t0=$(date +%s)
  SECTION_S=$t timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUT/sections.tsv"
  echo "   exit $rc after $(($(date +%s) - t0))s"
  tail -n 1 "$OUT/$name.log" | cut -c1-300 | sed 's/^/   /'
}

bench=("$PY" -m benchmarks.gpu_bench ${GPU_CHECK_SMOKE:+--smoke})   # an array: `timeout` runs no shell functions

nvidia-smi -L > "$OUT/nvidia-smi.log" 2>&1
cat "$OUT/nvidia-smi.log"
section env 30 10 "${bench[@]}" env --out "$OUT/env.json"
section cuda_tests 70 30 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
section target 90 40 "${bench[@]}" target --save /tmp/gpu-q8 --out "$OUT/target.json"
section drafter 120 40 "${bench[@]}" drafter --out "$OUT/drafter.json"
runs=(pipelined_cuda lockstep_cuda pipelined_host)
for i in "${!runs[@]}"; do
  v=${runs[$i]}
  share=$(( $(left) / (${#runs[@]} - i) ))
  (( share > 150 )) && share=150
  section "pipe_$v" "$share" 60 "${bench[@]}" pipeline --variant "$v" --target-dir /tmp/gpu-q8 --out "$OUT/pipe_$v.json"
done
section tiny 90 40 "${bench[@]}" tiny --out "$OUT/tiny.json"
section nodes 70 40 "${bench[@]}" nodes --out "$OUT/nodes.json"
section serving 100 60 "${bench[@]}" serving --out "$OUT/serving.json"

if ! "${bench[@]}" collect "$OUT" --started "$STARTED" --out "$OUT/gpu_check.json" \
    > "$OUT/collect.log" 2>&1; then
  echo "{\"check\": \"gpu_check\", \"failed\": [{\"section\": \"collect\", \"error\": \"$(tail -n 1 "$OUT/collect.log" | tr -d '"\\')\"}]}" \
    | tee "$OUT/gpu_check.json" > "$OUT/collect.log"
fi
tail -n 1 "$OUT/collect.log"
