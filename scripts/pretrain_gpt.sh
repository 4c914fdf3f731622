#!/usr/bin/env bash
# Pretrain a GPT under torchrun, on one machine or many.
#
#   bash scripts/pretrain_gpt.sh [pretrain_gpt.py flags...]
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node        (default: GPUs on this node, else 2)
#   NNODES          number of nodes           (default 1; SLURM_NNODES when under SLURM)
#   NODE_RANK       this node's index         (default 0; SLURM_NODEID when under SLURM)
#   MASTER_ADDR     rendezvous host           (default 127.0.0.1)
#   MASTER_PORT     rendezvous port           (default 29500)
#   MAX_RESTARTS    restarts after a worker dies (default 0); with --save DIR --load DIR
#                   the job resumes from its last checkpoint
# Flags pass straight through to scripts/pretrain_gpt.py; with none, a small GPT
# trains on the built-in corpus for 200 iterations.
# This script's process becomes the launcher (exec below), and the workers end with it,
# a kill -9 included (hybrid/train/orphans.py).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# When the job was launched: the workers log launch-to-first-iteration from it.
export HYBRID_LAUNCHED_AT=${HYBRID_LAUNCHED_AT:-$(date +%s.%N)}

if [ -z "${NPROC_PER_NODE:-}" ]; then
  # The GPUs this node shows, counted without starting Python (importing torch to ask
  # costs seconds): CUDA_VISIBLE_DEVICES' entries when it is set, else the driver's
  # device nodes; none means 2 CPU processes.
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
    NPROC_PER_NODE=0
    for d in "${visible[@]}"; do
      if [ -n "${d// /}" ]; then NPROC_PER_NODE=$((NPROC_PER_NODE + 1)); fi
    done
  else
    NPROC_PER_NODE=$( (compgen -G "/dev/nvidia[0-9]*" || true) | wc -l)
  fi
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=2
fi
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for var in NPROC_PER_NODE NNODES NODE_RANK MASTER_PORT; do
  if ! [[ "${!var}" =~ ^[0-9]+$ ]]; then
    echo "pretrain_gpt.sh: error: $var must be a whole number, got '${!var}'" >&2
    exit 2
  fi
done

# Preflight: reject a bad command line with one message before any worker starts.
WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) python "$here/pretrain_gpt.py" --check-config "$@"

# torchrun, except that a failed worker's one error line (and its exit code) stay the job's
# whole report: torchrun would add its own traceback and a failure table.
torchrun=(python "$here/torchrun_quiet.py")
if [ "$NNODES" -eq 1 ]; then
  exec "${torchrun[@]}" --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    "$here/pretrain_gpt.py" "$@"
fi
exec "${torchrun[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-hybrid}" \
  "$here/pretrain_gpt.py" "$@"
