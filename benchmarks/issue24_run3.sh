#!/bin/bash
# Issue 24, run 3 on one H200 (docs/gpu-runs/gain_truth-run3.md): the checkpoint incident replay, then
# benchmarks/gain_truth.py on Llama and Qwen3 (2 interleaved rounds, 3 processes alive, one timed at a time).
# Each step has a hard deadline so the whole stays under $LIMIT seconds; everything lands in $OUT/run3.tar.gz.
set -u
LIMIT=${LIMIT:-465}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
run_for() {  # run_for SECONDS CMD...: the command in its own process group, killed (group and all) at the deadline
  local secs=$1; shift
  setsid "$@" & local pid=$!
  ( sleep "$secs"; kill -TERM -- -"$pid" 2>/dev/null; sleep 3; kill -KILL -- -"$pid" 2>/dev/null ) & local w=$!
  wait "$pid"; local rc=$?; kill "$w" 2>/dev/null; return $rc
}
R=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$R/device.txt" 2>&1
run_for 120 python3 benchmarks/checkpoint_replay.py --out "$R/replay" > "$R/replay_stdout.txt" 2>&1
echo "replay rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 "$R/replay_stdout.txt"
L1=$(( ($(left) - 15) / 2 ))
run_for "$L1" env OUT="$R/llama" python3 benchmarks/gain_truth.py --models llama --rounds 2 --overlap 3 --steps 6 \
  --warmup 2 --timeout 150 --budget $(( L1 - 60 )) > "$R/llama_stdout.txt" 2>&1
echo "llama rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "round|^\|" "$R/llama_stdout.txt" | tail -30
L2=$(( $(left) - 10 ))
run_for "$L2" env OUT="$R/qwen3" python3 benchmarks/gain_truth.py --models qwen3 --rounds 2 --overlap 3 --steps 6 \
  --warmup 2 --timeout 150 --budget $(( L2 - 60 )) > "$R/qwen3_stdout.txt" 2>&1
echo "qwen3 rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "round|^\|" "$R/qwen3_stdout.txt" | tail -30
tar -czf "$OUT/run3.tar.gz" -C "$R" .
cp "$R/llama_stdout.txt" "$R/qwen3_stdout.txt" "$R/replay_stdout.txt" "$OUT/" 2>/dev/null
echo "done at $(( $(date +%s) - T0 )) s"
