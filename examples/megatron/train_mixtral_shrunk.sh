#!/bin/bash
# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh with its parallelism
# kept (PP 4, experts over EP, the alltoall dispatcher, --moe-grouped-gemm): the entry
# point renamed (pretrain_gpt.py -> hybrid's scripts/pretrain_gpt.py), the same
# positional arguments and flag arrays, the sizes shrunk to train in seconds on a CPU
# (4 layers of width 64, 8 experts of width 128, 32 tokens), and the parallel sizes cut
# to fit 8 ranks: --pipeline-model-parallel-size 4 x --expert-model-parallel-size 2 (the
# original's 4 x 8 needs 32 GPUs). --sequence-parallel stays: at TP 1 it has nothing to
# split, and hybrid drops it as Megatron does.
#
#   bash examples/megatron/train_mixtral_shrunk.sh CKPT_DIR TOKENIZER DATA_PREFIX
#
# TOKENIZER is the model's Hugging Face tokenizer (tokenizer.json, or its directory):
# hybrid's Llama2Tokenizer reads that rather than a SentencePiece .model file. DATA_PREFIX
# is a Megatron .bin/.idx pair (<prefix>_text_document), for example from
# scripts/preprocess_data.py --tokenizer-type HuggingFaceTokenizer with that tokenizer.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29500"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3
TRAIN_ITERS=${TRAIN_ITERS:-8}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 32
    --max-position-embeddings 64
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters $TRAIN_ITERS
    --lr-decay-iters 8
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 2
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 4 \
    --eval-interval 4 \
    --eval-iters 1 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi

here=$(cd "$(dirname "$0")/../.." && pwd)
torchrun ${DISTRIBUTED_ARGS[@]} "$here/scripts/pretrain_gpt.py" \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
