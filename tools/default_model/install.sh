#!/bin/bash
# Here, after device_train.sh: unpack its output (the folder the run tool's files landed in) into
# models/default, then add the router statistics and verify against transformers and moerun.
#   bash tools/default_model/install.sh /work/.device/N
set -euo pipefail
SRC=$1; D=tools/default_model; M=models/default; PY=${PY:-.venv/bin/python}
rm -rf $M && mkdir -p $M
cp $SRC/*.safetensors $M/ && tar xzf $SRC/export_meta.tar.gz -C $M && chmod 644 $M/*
mv $M/train_report.json $D/train_report.json
cp $SRC/train.log $D/train.log
sed -i 's/"tokenizer_class": "TokenizersBackend"/"tokenizer_class": "PreTrainedTokenizerFast"/' $M/tokenizer_config.json
$PY $D/router_stats.py $M
$PY $D/samples_rp.py $M
cargo build --release -p moerun-cli
$PY $D/verify.py --model $M --moerun target/release/moerun
du -cb $M/* | tail -1
