#!/usr/bin/env bash
# Run GPU benchmark phases in one device call: benchmarks/gpu_run.sh PHASE[:SECONDS] ...
# Each phase's output goes to $OUT/<phase>.log (and its own files under $OUT); a failing or timed-out
# phase does not stop the next. Install first: python3 -m pip install --no-deps --no-build-isolation -e .
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
for spec in "$@"; do
  phase=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=300
  case $phase in
    kernels)     cmd="python3 benchmarks/kernels.py" ;;
    kernels_q)   cmd="python3 benchmarks/kernels.py --quick" ;;
    e2e)         cmd="python3 benchmarks/kernels_e2e.py --steps 8" ;;
    rotary)      cmd="python3 benchmarks/rotary.py" ;;
    hf_e2e)      cmd="python3 benchmarks/hf_llama_e2e.py" ;;
    ce)          cmd="python3 benchmarks/cross_entropy.py" ;;
    ce_sweep)    cmd="env SWEEP_PARTS=ce,lce_e2e python3 benchmarks/cross_entropy.py --sweep" ;;
    rotary_sweep) cmd="python3 benchmarks/rotary.py --sweep" ;;
    ce_sweep_k)  cmd="env SWEEP_PARTS=ce python3 benchmarks/cross_entropy.py --sweep" ;;
    rotary_c)    cmd="python3 benchmarks/rotary.py --grad-layout contiguous" ;;
    rotary_prof) cmd="python3 benchmarks/rotary.py --profile --repeats 2" ;;
    rotary_prof_c) cmd="python3 benchmarks/rotary.py --profile --repeats 2 --grad-layout contiguous" ;;
    e2e_prof)    cmd="python3 benchmarks/hf_llama_e2e.py --configs compile,compile_patch --vocab 128256 --steps 8 --profile" ;;
    e2e_mem)     cmd="python3 benchmarks/hf_llama_e2e.py --configs eager_patch,eager_liger --steps 5 --warmup 3" ;;
    flops)       cmd="python3 benchmarks/flops_validation.py" ;;
    fleet)       cmd="python3 benchmarks/fleet_overhead.py" ;;
    tests_new)   cmd="env MFUWATCH_KERNEL_TESTS_ON_GPU=1 python3 -m pytest -q -x tests/kernels/test_rotary.py tests/kernels/test_patch_rotary.py" ;;
    host)        cmd="python3 benchmarks/host_overhead.py" ;;
    tests)       cmd="env MFUWATCH_KERNEL_TESTS_ON_GPU=1 python3 -m pytest -q -x tests/kernels" ;;
    validate)    cmd="python3 benchmarks/agent_validation.py" ;;
    profiler)    cmd="python3 benchmarks/profiler_overhead.py" ;;
    ncu)         cmd="python3 benchmarks/ncu_agreement.py --layers 2 --timeout $((secs - 30))" ;;
    ddp)         cmd="python3 benchmarks/ddp_validation.py --quick" ;;
    *) echo "unknown phase $phase"; continue ;;
  esac
  echo "=== $phase ($cmd, limit ${secs}s) $(date +%T)"
  timeout "$secs" $cmd > "$OUT/$phase.log" 2>&1; rc=$?
  echo "=== $phase rc=$rc $(date +%T)"
  tail -c 2500 "$OUT/$phase.log"
done
echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
