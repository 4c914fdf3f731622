#!/usr/bin/env bash
# GPT-2 presets: bash examples/pretrain_gpt2.sh {125m|350m|1.3b} [more flags]
#
#   size   layers hidden heads   TP  ZeRO    parameters (GPT-2 vocab)
#   125m   12     768    12      1   1       124M
#   350m   24     1024   16      2   1       355M
#   1.3b   24     2048   16      4   1       1.31B
#
# Why stage 1 for all three: a step is 512 samples of 4 per micro-batch, so each
# rank runs 512 / (4 x DP) micro-batches, and stages 2 and 3 reduce-scatter every
# one of them while stage 1 reduces once per step. scripts/estimate_memory.py,
# given these flags and --world-size 8 or 32 --gpu-memory-gb 80, predicts for
# 1.3b at 32 ranks (DP 8, 16 micro-batches) a peak of 6.7 GiB at stage 1 and 6.1
# at stage 2, against 1.6 GiB and 17.8 GiB sent per rank per step: every stage
# fits, and stage 1 sends the least, so it recommends 1 (and the same for 125m
# and 350m). Rerun it for a smaller device or a longer sequence: it names the
# stage that fits.
#
# 1024-token context, bf16 with fp32 master weights, cosine schedule, checkpoints
# every 1000 iterations (resuming from them), TensorBoard. Needs preprocessed data
# and GPT-2 BPE files on disk, and the usual launcher variables for many nodes:
#   DATA_PATH=data/corpus VOCAB_FILE=gpt2/vocab.json MERGE_FILE=gpt2/merges.txt \
#   NNODES=4 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=node0 bash examples/pretrain_gpt2.sh 1.3b
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: pretrain_gpt2.sh 125m|350m|1.3b [flags]" >&2
  exit 2
fi
size="$1"
shift
case "$size" in
  125m) shape=(--num-layers 12 --hidden-size 768 --num-attention-heads 12
               --tensor-model-parallel-size 1 --zero-stage 1) ;;
  350m) shape=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16
               --tensor-model-parallel-size 2 --zero-stage 1) ;;
  1.3b) shape=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16
               --tensor-model-parallel-size 4 --zero-stage 1) ;;
  *) echo "pretrain_gpt2.sh: unknown size '$size' (125m, 350m or 1.3b)" >&2; exit 2 ;;
esac
save="${SAVE:-runs/gpt2_$size}"
exec bash "$here/../scripts/pretrain_gpt.sh" "${shape[@]}" \
  --seq-length 1024 --max-position-embeddings 1024 --bf16 --overlap-comm \
  --micro-batch-size 4 --global-batch-size 512 \
  --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 2000 --lr-decay-style cosine \
  --train-iters 300000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --tokenizer-type gpt2bpe --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" \
  --merge-file "${MERGE_FILE:?set MERGE_FILE}" --data-path "${DATA_PATH:?set DATA_PATH}" \
  --split 949,50,1 --eval-interval 1000 --eval-iters 20 --log-interval 10 \
  --save "$save" --load "$save" --save-interval 1000 --keep-last 3 \
  --tensorboard-dir "$save/tb" "$@"
