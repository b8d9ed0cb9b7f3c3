#!/usr/bin/env bash
# The example end to end, as its README runs it (CI runs this file).
set -euo pipefail
cd "$(dirname "$0")"
python make_data.py
p2pfl validate topology.yaml
python compare.py
