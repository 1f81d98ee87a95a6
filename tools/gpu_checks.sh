#!/usr/bin/env bash
# Every GPU check remat has, in one call (a lent GPU's time is short: one prepared run).
#
#     OUT=/tmp/gpu_out bash tools/gpu_checks.sh        # from the repo root, on a CUDA machine
#
# Runs from a plain checkout (PYTHONPATH=repo root, remat need not be installed). Each step
# has its own time limit, so one failing or hanging step does not cost the others; every
# step's log and results are packed into $OUT/gpu_results.tar.gz, and $OUT/summary.txt
# lists each step's exit status and seconds. Steps, in order of what matters most:
#   env      torch/CUDA versions and the device
#   smoke    remat on a tiny model on CUDA (imports, compile, plan, backward)
#   pytest   the tests marked cuda
#   e2e      benchmarks/cuda_e2e.py: gradients, budget, predicted vs measured peak per zoo model
#   cost     benchmarks/cost_model_accuracy.py --device cuda
#   pareto   benchmarks/pareto.py --device cuda
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/results"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
PY=${PY:-python3}
SCALE=${GPU_TIME_SCALE:-1}   # multiply every step's limit (e.g. 0.5 for a quick rerun)
TOTAL=${GPU_TOTAL_S:-540}    # all steps end by then, leaving time to pack the results
DEADLINE=$((SECONDS + TOTAL))

step() {
    local name=$1 limit=$2
    shift 2
    limit=$(python3 -c "print(max(5, min(int($limit * $SCALE), $DEADLINE - $SECONDS - 10)))")
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$WORK/$name.log"
}

step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, sys, platform; print(torch.__version__, torch.version.cuda, sys.version, torch.cuda.get_device_name(0))'; $PY -m pip list 2>/dev/null | grep -i -E '^(torch|triton|scipy|networkx|matplotlib|sympy) '"

step smoke 90 $PY - <<'EOF'
import torch, remat, time
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(1024, 256)).cuda()
x = torch.randn(512, 256, device="cuda")
be = remat.backend(None, dump_dir="/tmp/remat_smoke_dump")
t0 = time.perf_counter()
out = torch.compile(model, backend=be)(x)
out.sum().backward()
torch.cuda.synchronize()
plan = be.compiled_graphs[-1].plan
print(f"compiled in {time.perf_counter() - t0:.1f} s; predicted {plan.predicted_peak_bytes} B; "
      f"saved {len(plan.saved)}, recomputed {len(plan.recomputed)}; hardware {be.options.hardware}")
EOF

step pytest 90 $PY -m pytest -q -m cuda tests/ -p no:cacheprovider

step e2e 170 $PY benchmarks/cuda_e2e.py --models gpt cnn llama mlp --steps 20 --max-minutes 2 --out "$WORK/results"

step cost 120 $PY benchmarks/cost_model_accuracy.py --device cuda --max-minutes 1.6 --out "$WORK/results"

step pareto 190 $PY benchmarks/pareto.py --device cuda --max-minutes 2.8 --out-dir "$WORK/results"

cp "$OUT/summary.txt" "$WORK/"
tar -C "$WORK" -czf "$OUT/gpu_results.tar.gz" .
ls -la "$WORK" "$WORK/results"
cat "$OUT/summary.txt"
