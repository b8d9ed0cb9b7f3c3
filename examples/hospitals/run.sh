#!/usr/bin/env bash
# The example end to end, as its README runs it (CI runs this file).
set -euo pipefail
cd "$(dirname "$0")"
python make_data.py
p2pfl validate topology.yaml
python compare.py
p2pfl export runs/uapdfl --node hospital-c --format onnx --out runs/export
p2pfl predict runs/uapdfl --node hospital-c data/new-patients.csv --out runs/new-patients.csv
