# One device session (run from the repo root on a GPU machine, torch preinstalled):
# the schedules on CUDA tensors vs sync TP, the TP=1 readiness timings (split cost, MFU, eager
# and compiled pieces), then
# `domino train` on CUDA (fp32, bf16, a 100M model).
# Usage: bash scripts/device_session.sh [quick]   (quick: skip the small-model training runs)
nvidia-smi -L; python3 -c "import torch;print('torch',torch.__version__,torch.cuda.get_device_name())"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
echo "=== device_check (TP=2, 2 ranks on one GPU, gloo on CUDA tensors)"
timeout 170 python3 scripts/device_check.py --section tp2 --device cuda --steps 10 2>&1 | tee "$OUT/device_check.log"
echo "=== device_check readiness (TP=1, one GPU, split forced: step time, split cost, MFU, bf16)"
timeout 300 python3 scripts/device_check.py --section readiness --device cuda --budget-s 200 --compile both 2>&1 | tee "$OUT/readiness.log"
if [ "$1" != quick ]; then
  echo "=== train small default model, TP=1, NCCL, fp32 then bf16"
  for p in no-bf16 bf16; do timeout 60 python3 -m domino.cli train --device cuda --nproc 1 --tensor-model-parallel-size 1 --train-iters 60 --tokenizer-type byte --log-interval 20 --eval-interval 60 --eval-iters 2 --sample-tokens 40 --$p --save /tmp/r_$p 2>&1 | grep -v "train:" | tail -12; done
fi
echo "=== train a 100M model, bf16, NCCL, TP=1 (the stack runs unsplit: nothing to hide)"
timeout 120 python3 -m domino.cli train --device cuda --nproc 1 --tensor-model-parallel-size 1 --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --micro-batch-size 16 --global-batch-size 16 --train-iters 60 --tokenizer-type byte --log-interval 20 --eval-interval 60 --eval-iters 2 --sample-tokens 40 --bf16 --save /tmp/r_big 2>&1 | grep -v "train:" | grep -v "^[a-z_0-9]* = " | tail -14
cp /tmp/r_big/metrics.jsonl "$OUT/big_metrics.jsonl" 2>/dev/null; true
