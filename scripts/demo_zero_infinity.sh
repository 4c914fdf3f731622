#!/usr/bin/env bash
# ZeRO-Infinity on one small machine: a GPT whose fp32 model states (16 bytes per
# parameter) are well past the machine's RAM trains at ZeRO-3 with its optimizer
# states and parameter shards on disk, saves a checkpoint, and resumes from it.
#
#   bash scripts/demo_zero_infinity.sh [WORK_DIR]      (default: ./zero_infinity_demo)
#
# SUMMARY_ONLY=1 prints the JSON again from WORK_DIR's logs without training.
# WORK_DIR gets the swap files (deleted at each clean exit), the checkpoint and the
# logs; it needs about 24 GB per rank of swap plus 12 bytes per parameter of
# checkpoint. Environment: NPROC_PER_NODE (default 2), LAYERS (default 21: 2.38B
# parameters at width 3072), STEPS (default 3), and EXTRA (more pretrain_gpt.py flags).
# Prints one JSON object: the model's size against the RAM, the estimator's bytes per
# rank, the measured peak RSS (the largest rank's) and each step's time split.
# fp32 on purpose: a CPU without bf16 matrix units multiplies bf16 about 300x slower.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(realpath -m "${1:-zero_infinity_demo}")"
export NPROC_PER_NODE=${NPROC_PER_NODE:-2}
mkdir -p "$work"
[ -n "${SUMMARY_ONLY:-}" ] || rm -rf "$work/ckpt" "$work"/run*.jsonl

flags=(--num-layers "${LAYERS:-21}" --hidden-size 3072 --num-attention-heads 24
       --seq-length 128 --micro-batch-size 1 --global-batch-size "$NPROC_PER_NODE"
       --hidden-dropout 0 --attention-dropout 0 --lr 1e-5 --min-lr 1e-6
       --zero-stage 3 --offload-optimizer nvme --offload-param nvme
       --offload-nvme-path "$work/swap" --eval-iters 0 --log-interval 1 ${EXTRA:-})
steps=${STEPS:-3}

if [ -z "${SUMMARY_ONLY:-}" ]; then
python "$here/estimate_memory.py" "${flags[@]}" --world-size "$NPROC_PER_NODE" \
  --device cpu --format json > "$work/estimate.jsonl"
/usr/bin/time -v bash "$here/pretrain_gpt.sh" "${flags[@]}" --train-iters "$steps" \
  --save "$work/ckpt" --save-interval "$steps" --log-json "$work/run1.jsonl" \
  2> "$work/run1.time" | tee "$work/run1.log"
/usr/bin/time -v bash "$here/pretrain_gpt.sh" "${flags[@]}" --train-iters $((steps + 1)) \
  --load "$work/ckpt" --log-json "$work/run2.jsonl" \
  2> "$work/run2.time" | tee "$work/run2.log"
fi

python - "$work" <<'EOF'
import json, os, sys

work = sys.argv[1]
rows = [json.loads(line) for line in open(os.path.join(work, "estimate.jsonl"))]
est = next(r["offload"] for r in rows if "offload" in r)
params = next(r["params_per_tp_rank"] for r in rows if "params_per_tp_rank" in r)
ram = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1]) * 1024
predicted = est["host_bytes"]  # --device cpu: the device's terms are host memory too


def steps(name):
    out = []
    for line in open(os.path.join(work, name)):
        m = json.loads(line)
        if "offload_time_s" not in m:
            continue
        t = m["offload_time_s"]
        out.append({"iteration": m["iteration"], "loss": m["loss"],
                    "step_s": round(m["step_time_s"], 2),
                    "forward_backward_s": round(m["step_time_s"] - t["host_step"], 2),
                    "optimizer_step_s": round(t["host_step"], 2),
                    "adam_kernels_s": round(t["adam"], 2),
                    "swap_io_wait_s": round(t["io_wait"], 2),
                    "peak_rss_bytes_max_rank": m["peak_memory_bytes"],
                    "rss_over_predicted": round(m["peak_memory_bytes"] / predicted, 3),
                    "disk_bytes_per_rank": m["model_state_bytes"]["disk"]})
    return out


ckpt = os.path.join(work, "ckpt")
ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
print(json.dumps({
    "parameters": params, "fp32_model_state_bytes": 16 * params, "ram_bytes": ram,
    "model_states_over_ram": round(16 * params / ram, 2),
    "predicted_rss_bytes_per_rank": predicted, "predicted": est["terms"],
    "predicted_disk_bytes_per_rank": est["disk_bytes"],
    "disk_bytes_per_step_per_rank": est["disk_bytes_per_step"],
    "train": steps("run1.jsonl"), "resumed": steps("run2.jsonl"),
    "checkpoint_bytes": ckpt_bytes}, indent=1))
EOF
