#!/bin/bash
# run 9 call 3 (device, repo root): bash .gpu/kern5/run3.sh
set -o pipefail
python3 -m pip install -q --no-deps --no-build-isolation .whl/all/ijson-*.whl .whl/all/liger_kernel-*.whl 2>&1 | tail -2
cd .gpu/kern5 && python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv | tee $OUT/smi.txt
export PYTHONUNBUFFERED=1
MFUWATCH_KERNEL_TESTS_ON_GPU=1 timeout 170 python3 -m pytest -q -x -n 8 tests/kernels/test_cross_entropy.py \
  tests/kernels/test_linear_cross_entropy.py -k "fast or fma_pipe or forward_backward_match or largest_vocabulary or linear" \
  -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/pytest_gpu.txt
W="8192,8,fast,0,1003;8192,8,fast,0,3;4096,8,fast,2,1004;8192,8,fast,2,1003;4096,4,fast,0,1014;4096,8,fast,0,1014;2048,4,fast,0,1004;4096,4,fast,0,1011;8192,8,fast,0,1001;2048,4,rev,0,4"
export MFUWATCH_KERNELS_AUTOTUNE=1 CE_PLAIN="$W" CE_SOFTCAP="$W;4096,4,team,4,1;2048,4,row,0,1"
timeout 330 python3 benchmarks/cross_entropy_fast.py --parts check,sweep,providers,lce 2>&1 | tee $OUT/log.txt
