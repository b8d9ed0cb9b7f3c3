#!/usr/bin/env bash
# The example end to end, as its README runs it (CI runs this file).
set -euo pipefail
cd "$(dirname "$0")"
python make_data.py
p2pfl validate topology.yaml
p2pfl swarm topology.yaml --out runs/digits --no-progress
p2pfl export runs/digits --node n0 --format onnx --out runs/export
python check_onnx.py runs/digits n0 runs/export
p2pfl predict runs/digits --node n0 data/holdout --out runs/holdout-predictions.csv
