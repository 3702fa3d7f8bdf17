#!/usr/bin/env bash
# GPU bring-up and measurements in one call of at most 9 minutes on a lent, bare CUDA
# machine (the device tool); builds and installs nothing. Uses that machine's own python3
# (CUDA torch, transformers, pyarrow, pytest, pytest-timeout) with this checkout on
# PYTHONPATH. Every section runs under its own `timeout`, capped by what is left of
# GPU_CHECK_BUDGET_S (default 480 s; with the 10 s kill grace, the final collect and
# the archive the call ends within about 8.5 minutes). Until the pipeline starts, 200 s
# of the budget stay reserved for it. A section with too little time left is skipped
# (MIN, the second figure), a failed one recorded, and the script goes on. In order,
# cheapest and most telling first (cap and minimum in seconds):
#   env          versions, devices, free /dev/shm and /tmp                       20  5
#   (prepare)    in the background from here, joined before `drafter` (at most 240):
#                the pipeline's target built on cuda:0 and saved (a Qwen3-8B shape
#                cut to 12 layers, random bf16, 7 GB) and its plan
#                (`launch.py --plan-only` with the pipeline's settings)
#   cuda_tests   pytest -v -m gpu on the files that have such tests (pinned and
#                CUDA-IPC rings, flex_attention and the loss on CUDA), 110 s a test
#                (then it fails, the others run): room for cold Inductor/Triton
#                compiles; counts come from the per-test lines when the cap kills
#                pytest                                                         150 60
#   tiny    (3)  `--plan-only`, then the tiny default config (one epoch of 256
#                samples) 2-2 on cuda:0, feature ring on cuda:0 shared by CUDA IPC,
#                against the single-process reference (equal within tolerance, not
#                bits); each process's planned memory beside its measured peak  70 35
#   nodes   (3)  two nodes on loopback, each 1-1 on cuda:0, gradient chain over
#                gloo (NCCL refuses two ranks on one GPU): identical replicas     50 25
#   target  (2a) random Qwen3-8B-shaped bf16 target built on cuda:0,
#                TargetModel.hidden on 8 x 2048 tokens: tokens/s, TFLOP/s, MFU    50 25
#   drafter (2b) the pipeline's 5-layer 8B-shaped drafter step (drafter_step, bf16
#                autocast, fp32 master weights) on 8 x 2048 tokens, 512 anchors,
#                block 16, at the micro-batch the pipeline's plan chose: tokens/s,
#                TFLOP/s, MFU (beside SpecForge's ~44%), max_memory_allocated and
#                _reserved beside the plan's traced step peak                   100 45
#   pipeline (2c) launch.py 1-1 on cuda:0 with the prepared target, loaded by the
#                target actor (target.share_weights=off), 2b's drafter, 4 threads
#                an actor (train.num_threads=4), the feature ring, optimizer and
#                micro-batch where the plan puts them; stopped by time (SIGTERM,
#                45 s before the cap) after steady steps: steady tokens/s, stage
#                MFUs, each process's planned memory beside its measured peak;
#                what is left, at least 200 by the reservation                  300 150
#   serving      prepare --server against a real vLLM; the lent machines have
#                none, so it skips itself, or is skipped for time                  60 20
# Logs, plans and section JSONs go to $WORK (/tmp/gpu_check_work), run dirs to /tmp/gpu-*.
# $OUT gets three files: gpu_check.json (the final line), sections.tsv, and logs.tgz
# ($WORK, and this call's run dirs' events.log, error.txt, summary.json, status.json,
# config.yaml, metrics.jsonl, reference.json). The output ends with one line per
# section, one per planned process (planned GiB beside the measured peak allocated and
# reserved) and the final line {"check": "gpu_check", ..., "plan_vs_measured": [...],
# "failed": [...]}.
# Without a GPU, GPU_CHECK_SMOKE=1 GPU_CHECK_PYTHON=.venv/bin/python runs the same
# sections on CPU with tiny shapes (gpu_bench --smoke) and three times the caps and
# budget, to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
export WORK
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
SCALE=1
[[ -n ${GPU_CHECK_SMOKE:-} ]] && SCALE=3
BUDGET_S=${GPU_CHECK_BUDGET_S:-$((480 * SCALE))}
PY=${GPU_CHECK_PYTHON:-python3}
STARTED=$(date +%s)
RESERVE_S=$((200 * SCALE))   # kept for the pipeline until it starts
touch "$WORK/started"        # files older than this in /tmp/gpu-* are another call's
: > "$WORK/sections.tsv"

left() { echo $((BUDGET_S - ($(date +%s) - STARTED) - RESERVE_S)); }

# section NAME CAP MIN CMD...: CMD under `timeout` for min(CAP, time left) seconds
# (SECTION_S tells it how long it has), output in $WORK/NAME.log; skipped when fewer
# than MIN seconds are left (both scaled by SCALE). Appends "NAME<TAB>exit code or
# skipped<TAB>seconds" to sections.tsv and prints one line.
section() {
  local name=$1 cap=$(($2 * SCALE)) min=$(($3 * SCALE)) t rc t0
  shift 3
  t=$(left)
  (( t > cap )) && t=$cap
  if (( t < min )); then
    printf '%s\tskipped\t0\n' "$name" >> "$WORK/sections.tsv"
    echo "== $name: skipped (${t} s for it, needs ${min} s)"
    return
  fi
  t0=$(date +%s)
  SECTION_S=$t timeout -k 10 "$t" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$WORK/sections.tsv"
  echo "== $name: exit $rc after $(($(date +%s) - t0)) s of ${t}"
}

bench=("$PY" -m benchmarks.gpu_bench ${GPU_CHECK_SMOKE:+--smoke})   # an array: `timeout` runs no shell functions
gpu_tests=$(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort)

nvidia-smi > "$WORK/nvidia-smi.log" 2>&1
grep -E 'NVIDIA|MiB' "$WORK/nvidia-smi.log" | head -n 4 | cut -c1-120
section env 20 5 "${bench[@]}" env --out "$WORK/env.json"
# The pipeline's target and plan, made beside the next sections (their GPU use is
# small; this takes the GPU for seconds and 7 GB); joined before the drafter's section.
prep_t0=$(date +%s)
timeout -k 10 $((240 * SCALE)) "${bench[@]}" prepare --out "$WORK/prepare.json" > "$WORK/prepare.log" 2>&1 &
prep_pid=$!
# A test past 110 s fails by SIGALRM and the others run (setup.cfg's thread method would end pytest).
# shellcheck disable=SC2086  # one word per test file
section cuda_tests 150 60 "$PY" -m pytest -v -rA -m gpu -p no:cacheprovider --timeout=110 -o timeout_method=signal \
  --durations=0 --junitxml="$WORK/cuda_tests.xml" $gpu_tests
section tiny 70 35 "${bench[@]}" tiny --out "$WORK/tiny.json"
section nodes 50 25 "${bench[@]}" nodes --out "$WORK/nodes.json"
section target 50 25 "${bench[@]}" target --out "$WORK/target.json"
wait "$prep_pid"
rc=$?
printf 'prepare\t%s\t%s\n' "$rc" "$(($(date +%s) - prep_t0))" >> "$WORK/sections.tsv"
echo "== prepare: exit $rc, joined after $(($(date +%s) - prep_t0)) s"
section drafter 100 45 "${bench[@]}" drafter --out "$WORK/drafter.json"
RESERVE_S=0
section pipeline 300 150 "${bench[@]}" pipeline --out "$WORK/pipeline.json"
section serving 60 20 "${bench[@]}" serving --out "$WORK/serving.json"

if ! "${bench[@]}" collect "$WORK" --started "$STARTED" --out "$OUT/gpu_check.json" > "$WORK/collect.log" 2>&1; then
  echo "{\"check\": \"gpu_check\", \"failed\": [{\"section\": \"collect\", \"error\": \"$(tail -n 1 "$WORK/collect.log" | tr -d '"\\')\"}]}" \
    > "$OUT/gpu_check.json"
  cat "$OUT/gpu_check.json" >> "$WORK/collect.log"
fi
cp "$WORK/sections.tsv" "$OUT/sections.tsv"

# logs.tgz: $WORK and this call's run-dir records, files over LIMIT left out; LIMIT
# shrinks until the archive is under the 16 MiB a file from $OUT may have.
for limit in 4M 512k 64k; do
  { find "$WORK" -type f -size "-$limit"
    find /tmp -mindepth 2 -maxdepth 5 -path '/tmp/gpu-*' -type f -size "-$limit" -newer "$WORK/started" \
      \( -name events.log -o -name error.txt -o -name summary.json -o -name status.json -o -name config.yaml \
         -o -name metrics.jsonl -o -name reference.json \) 2>/dev/null
  } | sed 's|^/||' > /tmp/gpu_check_pack.list
  tar czf "$OUT/logs.tgz" -C / -T /tmp/gpu_check_pack.list 2>/dev/null
  (( $(stat -c %s "$OUT/logs.tgz") < 15 * 2**20 )) && break
done

cat "$WORK/collect.log"
