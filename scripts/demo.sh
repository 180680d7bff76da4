#!/usr/bin/env bash
# The main job on its embedded default: a tiny megatron-core GPT on mock data, 2 ranks on CPU via
# torchrun. Run 1 is interrupted at iteration 20 (--exit-interval saves first); run 2 resumes from
# the tracker and finishes at 30. Creates .venv on first use. Output: ${DEMO_DIR:-./demo_run}.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
DEMO_DIR="${DEMO_DIR:-$ROOT/demo_run}"
CKPT="$DEMO_DIR/checkpoints"
rm -rf "$CKPT"
mkdir -p "$DEMO_DIR"

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
            --max-position-embeddings 64 --tokenizer-type NullTokenizer --vocab-size 256)
TRAIN_ARGS=(--micro-batch-size 2 --global-batch-size 8 --train-iters 30 --lr 1e-3 --min-lr 1e-4
            --lr-decay-style cosine --lr-warmup-iters 3 --weight-decay 0.01 --clip-grad 1.0
            --seed 1234 --mock-data --log-interval 5 --eval-interval 10 --eval-iters 2)
CKPT_ARGS=(--save "$CKPT" --load "$CKPT" --save-interval 10 --ckpt-format torch_dist)
LAUNCH=(torchrun --standalone --nnodes 1 --nproc-per-node 2)

echo "=== run 1: train until the interruption at iteration 20 ==="
"${LAUNCH[@]}" "$ROOT/pretrain.py" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${CKPT_ARGS[@]}" --exit-interval 20
echo "=== tracker after run 1: $(cat "$CKPT/latest_checkpointed_iteration.txt") ==="
echo "=== run 2: resume from the tracker and finish ==="
"${LAUNCH[@]}" "$ROOT/pretrain.py" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${CKPT_ARGS[@]}"
echo "=== done: checkpoints in $CKPT ==="
ls "$CKPT"
