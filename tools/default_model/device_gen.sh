#!/bin/bash
# Device call 2 of 3 (see README.md): reassemble the teacher GGUF, generate the corpus for
# GEN_MIN minutes into /tmp/corpus.jsonl (kept on the warm machine for call 3), smoke-test
# train.py on the first stories meanwhile, and send back the compressed corpus.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=tools/default_model
cat /tmp/wchunks/part00 /tmp/wchunks/part01 .wchunks/part02 > /tmp/smol.gguf || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import transformers, torch, tokenizers; print(transformers.__version__, torch.__version__, tokenizers.__version__)"
python3 $D/gen_corpus.py --gguf /tmp/smol.gguf --out /tmp/corpus.jsonl --minutes ${GEN_MIN:-7.5} \
    --batch ${GEN_BATCH:-2048} > $OUT/gen.log 2>&1 &
GEN=$!
sleep ${SMOKE_AFTER:-110}
head -n 4000 /tmp/corpus.jsonl > /tmp/smoke.jsonl
echo "smoke corpus: $(wc -l < /tmp/smoke.jsonl) docs"
python3 $D/train.py --corpus /tmp/smoke.jsonl --out /tmp/smoke --minutes 0.2 --batch 32 --warmup 10 \
    > $OUT/smoke.log 2>&1; echo "smoke rc=$?"
grep -v "^===\|^---" $OUT/smoke.log | grep -iv warn | cut -c1-300 | tail -25
wait $GEN
tail -5 $OUT/gen.log
wc -lc /tmp/corpus.jsonl
xz -T16 -6 -c /tmp/corpus.jsonl > $OUT/corpus.jsonl.xz
ls -la $OUT
