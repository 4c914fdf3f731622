#!/usr/bin/env bash
# GPT-2 350m (24 layers, hidden 1024, 16 heads, 1024 tokens), TP 2, ZeRO stage 1, bf16.
# Needs preprocessed data and the GPT-2 BPE files on disk:
#   DATA_PATH=data/corpus VOCAB_FILE=gpt2/vocab.json MERGE_FILE=gpt2/merges.txt \
#   NNODES=... NODE_RANK=... NPROC_PER_NODE=8 MASTER_ADDR=... bash examples/gpt_350m.sh [more flags]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../scripts/pretrain_gpt.sh" \
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --seq-length 1024 --max-position-embeddings 1024 \
  --tensor-model-parallel-size 2 --zero-stage 1 --bf16 --overlap-comm \
  --micro-batch-size 4 --global-batch-size 512 \
  --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 2000 --lr-decay-style cosine \
  --train-iters 300000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --tokenizer-type gpt2bpe --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" \
  --merge-file "${MERGE_FILE:?set MERGE_FILE}" --data-path "${DATA_PATH:?set DATA_PATH}" \
  --split 949,50,1 --eval-interval 1000 --eval-iters 20 --log-interval 10 \
  --save "${SAVE:-runs/gpt_350m}" --load "${SAVE:-runs/gpt_350m}" --save-interval 1000 --keep-last 3 \
  --tensorboard-dir "${SAVE:-runs/gpt_350m}/tb" "$@"
