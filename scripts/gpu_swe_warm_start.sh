#!/usr/bin/env bash
# The SWE warm start at GPU size: three larger fresh models on the committed tokenizer and data
# (examples/swe/data), trained side by side on one GPU for a fixed wall time each, no evaluation
# (held-out success is measured afterwards on a CPU with --eval-only: it needs bubblewrap).
#   bash scripts/gpu_swe_warm_start.sh OUT_DIR [MINUTES]     (DEVICE=cpu to try it without a GPU)
# Writes OUT_DIR/{a,b,c}/ (built models) and OUT_DIR/{a,b,c}.log.
set -euo pipefail
out=${1:?usage: gpu_swe_warm_start.sh OUT_DIR [MINUTES]}
minutes=${2:-6}
py=${PYTHON:-python3}
d=examples/swe/data
data=(--trajectories $d/train_noise1.jsonl.gz --trajectories $d/train_noise3.jsonl.gz
      --trajectories $d/synth0_noise1.jsonl.gz --trajectories $d/synth2_noise1.jsonl.gz
      --extra-tasks $d/tasks_synth0.jsonl.gz --extra-tasks $d/tasks_synth2.jsonl.gz
      --upsample synth0_noise1.jsonl=2 --upsample synth2_noise1.jsonl=2
      --edit-form unaddressed --max-tokens 1024 --mask-wrong --edit-weight 3
      --renames 1 --id-renames 6 --names broad --tokenizer examples/swe/model)
common=(--device "${DEVICE:-cuda}" --threads 4 --workers 5 --steps 1000000 --minutes "$minutes" --no-eval)
mkdir -p "$out"
# name  hidden layers batch lr
runs=("a 256 6 32 1e-3" "b 384 6 32 7e-4" "c 256 6 16 2e-3")
for run in "${runs[@]}"; do
  read -r name hidden layers batch lr <<<"$run"
  PYTHONUNBUFFERED=1 "$py" scripts/build_swe_model.py "${data[@]}" "${common[@]}" --hidden "$hidden" \
    --layers "$layers" --batch "$batch" --lr "$lr" --seed 0 --out "$out/$name" >"$out/$name.log" 2>&1 &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
