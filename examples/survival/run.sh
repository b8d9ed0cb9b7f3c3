#!/usr/bin/env bash
# The example end to end, as its README runs it (CI runs this file, on a few rounds).
set -euo pipefail
cd "$(dirname "$0")"
python make_data.py
p2pfl validate topology.yaml
p2pfl swarm topology.yaml --out runs/fedavg --set rounds=${ROUNDS:-3}
p2pfl swarm topology.yaml --out runs/local --set rounds=${ROUNDS:-3} --method local
