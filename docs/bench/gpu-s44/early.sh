#!/bin/sh
# Stop 44: the kernel's check before the model has arrived (the third staging call, after
# .gpu-1 and .gpu-2; this one carries .gpu-5, which holds the CUDA wheel's last part and the
# other wheels): install MLX and check/time the kernel alone.   sh docs/bench/gpu-s44/early.sh
set -eu
cd /tmp/stage
cat cuda.part.* > "$(awk '{print $2}' cuda.md5)" && md5sum -c cuda.md5
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl
cd - > /dev/null
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol
cd docs/bench/gpu-s44 && timeout 200 taskset -c 2-9 python3 fewq.py --no-model 2>&1 | tee "$OUT/fewq-kernel.txt"
