#!/bin/bash
# Multi-node draft-head training with torchrun (run on every node):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/torchrun_train.sh configs/llama31-8b-eagle3.yaml
set -euo pipefail
CONFIG=${1:?usage: scripts/torchrun_train.sh CONFIG [extra train-head flags]}
shift
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}; GPUS=${GPUS:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}; MASTER_PORT=${MASTER_PORT:-29500}
export WANDB_MODE=${WANDB_MODE:-offline}
exec .venv/bin/torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m draftheads.training.cli fit --config "$CONFIG" \
  --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS" --ckpt_path last "$@"
