#!/usr/bin/env bash
# GPU bring-up, in one call on a lent CUDA machine (the device tool); builds nothing.
# Uses that machine's own python3 (which carries a CUDA torch, transformers, pyarrow,
# pytest) with this checkout on PYTHONPATH. Fits in ~6 minutes; logs go to $OUT.
#   1. the CUDA-only tests: CUDA-IPC and pinned rings, flex_attention vs the dense mask
#   2. the pipeline with a bf16 target, drafter and optimizer on one GPU (1-1 and 2-2),
#      compared with the reference run on the same GPU (equal within tolerance, not bits)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
common=(--set data.cache_dir=/tmp/gpu-cache --set train.epochs=2)
python3 launch.py --topology 1-1 --run-dir /tmp/gpu-1-1 "${common[@]}" \
  --set 'topology.target_devices=[cuda:0]' --set 'topology.drafter_devices=[cuda:0]' 2>&1 | tee "$OUT/pipeline_1_1.log"
python3 launch.py --topology 2-2 --run-dir /tmp/gpu-2-2 "${common[@]}" \
  --set 'topology.target_devices=[cuda:0, cuda:0]' --set 'topology.drafter_devices=[cuda:0, cuda:0]' 2>&1 | tee "$OUT/pipeline_2_2.log"
python3 -m dflash_actors.reference --topology 2-2 "${common[@]}" 2>&1 | tail -1 | tee "$OUT/reference_2_2.log"
cp /tmp/gpu-2-2/events.log "$OUT/events_2_2.log" 2>/dev/null || true
# 3. the operator view on CUDA: GPU memory per actor in status.json and metrics.jsonl,
#    MFU against the device's peak in the summary (the H200 is in monitor.PEAK_TFLOPS)
cp /tmp/gpu-2-2/status.json /tmp/gpu-2-2/summary.json "$OUT/" 2>/dev/null || true
python3 - <<'PY' 2>&1 | tee "$OUT/monitor_2_2.log"
import json
recs = [json.loads(x) for x in open("/tmp/gpu-2-2/metrics.jsonl")]
gpu = {a: v["gpu_mem_mb"] for r in recs if r["kind"] == "resources" for a, v in r["actors"].items() if v["gpu_mem_mb"]}
stages = json.load(open("/tmp/gpu-2-2/summary.json"))["stages"]
print(json.dumps({"check": "monitor", "gpu_mem_mb": gpu, "gpus": [r.get("gpus") for r in recs if r["kind"] == "resources"][-1:],
                  "target": stages.get("target"), "drafter": stages.get("drafter")}))
PY
# 4. two nodes on one machine (loopback), each 1-1 on cuda:0, the gradient chain over
#    gloo from host memory (NCCL refuses two ranks on one GPU, so it cannot run here):
#    both must finish with identical replicas and the exchange time in their summaries
port=$((29500 + RANDOM % 1000))
for r in 0 1; do
  python3 launch.py --topology 1-1 --run-dir /tmp/gpu-nodes "${common[@]}" --nnodes 2 --node-rank $r \
    --master 127.0.0.1:$port --set runtime.collective_backend=gloo \
    --set 'topology.target_devices=[cuda:0]' --set 'topology.drafter_devices=[cuda:0]' > "$OUT/nodes_$r.log" 2>&1 &
done
wait
grep -h '"cluster"' "$OUT"/nodes_*.log | python3 -c "import json,sys; print(json.dumps({'check': 'two_nodes', 'cluster': [json.loads(l)['cluster'] for l in sys.stdin]}))" | tee "$OUT/nodes.json"
