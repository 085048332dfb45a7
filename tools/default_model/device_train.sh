#!/bin/bash
# Device call 3 of 3 (see README.md): train on /tmp/corpus.jsonl (left by call 2 on the warm
# machine; else unpacked from the carried .corpus/corpus.jsonl.xz), evaluate, sample, export.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=tools/default_model
test -s /tmp/corpus.jsonl || xz -dc .corpus/corpus.jsonl.xz > /tmp/corpus.jsonl || exit 1
rm -rf /tmp/export
python3 $D/train.py --corpus /tmp/corpus.jsonl --out /tmp/export --minutes ${TRAIN_MIN:-6.5} $@ 2>&1 \
    | grep -iv warn | tee $OUT/train.log
cp /tmp/export/*.safetensors $OUT/
tar czf $OUT/export_meta.tar.gz -C /tmp/export --exclude='*.safetensors' .
ls -la $OUT
