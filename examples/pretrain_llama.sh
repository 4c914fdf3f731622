#!/usr/bin/env bash
# Llama preset: bash examples/pretrain_llama.sh [more flags]
#
# The shape of Llama-3.2-1B: 16 layers, hidden 2048, 32 heads in 8 query groups
# (GQA), SwiGLU MLP of 8192, RoPE with base 500000 and Llama-3.1's frequency
# scaling by 32 (--use-rope-scaling, as Meta's config.json), RMSNorm, no biases, and a
# 128256-token vocabulary from a Hugging Face tokenizer.json (Llama 3's). One
# difference: the output layer is untied here (--untie-embeddings-and-output-
# weights), which Llama-3.2-1B ties; drop the flag to tie it. That is 1.50B
# parameters (1.24B tied), 749M per TP rank at TP 2.
#
# TP 2 with sequence parallelism, ZeRO stage 1, bf16 with fp32 master weights,
# 4096-token context, 512 x 4096 = 2M tokens per step, cosine schedule.
# scripts/estimate_memory.py, given these flags, --vocab-size 128256, --world-size
# 8 or 32 and --gpu-memory-gb 80, predicts at 32 ranks (DP 16, 16 micro-batches
# of 2) a peak of 13.3 GiB at stage 1 and 11.0 at stage 2, against 3.9 GiB and
# 43.2 GiB sent per rank per step: every stage fits and stage 1 sends the least,
# so it recommends 1 (the same at 8 ranks). Rerun it for a smaller device or a
# longer context.
#
# Needs preprocessed data (scripts/preprocess_data.py with the same tokenizer),
# the tokenizer file, and the usual launcher variables for many nodes:
#   DATA_PATH=data/corpus TOKENIZER_FILE=llama3/tokenizer.json \
#   NNODES=4 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=node0 bash examples/pretrain_llama.sh
# To start from Meta's weights instead, import them first (scripts/import_hf.py,
# which prints the flags of the checkpoint, rope_type "llama3" scaling included).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
save="${SAVE:-runs/llama_1b}"
exec bash "$here/../scripts/pretrain_gpt.sh" \
  --num-layers 16 --hidden-size 2048 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu \
  --position-embedding-type rope --rotary-base 500000 \
  --use-rope-scaling --rope-scaling-factor 32 \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --tensor-model-parallel-size 2 --sequence-parallel --zero-stage 1 \
  --seq-length 4096 --max-position-embeddings 4096 --bf16 --overlap-comm \
  --micro-batch-size 2 --global-batch-size 512 \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --lr-decay-style cosine \
  --train-iters 100000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --tokenizer-type hf --tokenizer-file "${TOKENIZER_FILE:?set TOKENIZER_FILE}" \
  --data-path "${DATA_PATH:?set DATA_PATH}" \
  --split 949,50,1 --eval-interval 1000 --eval-iters 20 --log-interval 10 \
  --save "$save" --load "$save" --save-interval 1000 --keep-last 3 \
  --tensorboard-dir "$save/tb" "$@"
