#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh with its pipeline kept:
# the entry point renamed (examples/classes/pretrain_gpt.py -> hybrid's
# scripts/pretrain_gpt.py), the same positional arguments and flag arrays, the
# sizes shrunk to train in seconds on a CPU, and the model parallelism cut to fit
# 4 ranks: --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 (the
# original's 8 x 16 needs 128 GPUs). The embedding and the output layer stay tied,
# as in the original: the first and the last stage each hold a copy and sum their
# gradients. train_gpt3_shrunk.sh beside it is the same script at PP 1.
# (Megatron's newest copy of the script replaced --rampup-batch-size with
# --step-batch-size-schedule, which hybrid does not take yet; this follows the
# copy before that change, as train_gpt3_shrunk.sh does.)
#
#   bash examples/megatron/train_gpt3_175b_pp2.sh CKPT_DIR TB_DIR VOCAB MERGES DATA_PREFIX
#
# DATA_PREFIX is a Megatron .bin/.idx pair (<prefix>_text_document), for example
# from scripts/preprocess_data.py with Megatron's own command line.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-4}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document
TRAIN_ITERS=${TRAIN_ITERS:-8}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 32
    --max-position-embeddings 32
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --rampup-batch-size 4 4 16
    --train-iters $TRAIN_ITERS
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .25
    --lr-decay-iters 8
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2
	--pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 4
    --eval-interval 4
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 1
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

here=$(cd "$(dirname "$0")/../.." && pwd)
torchrun ${DISTRIBUTED_ARGS[@]} "$here/scripts/pretrain_gpt.py" \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
