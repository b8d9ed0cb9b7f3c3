"""Local-only, FedAvg and UA-PDFL on the three clinics (a daemon per clinic, a private
broker), each clinic's final test MAE and RMSE, and the mean over clinics.

    python compare.py          # runs/<method>/, and results.json
"""

from __future__ import annotations

import json
from pathlib import Path

import p2pfl

HERE = Path(__file__).resolve().parent
METHODS = ("local", "fedavg", "uapdfl")


def main() -> None:
    table = {}
    for method in METHODS:
        run = p2pfl.run_swarm(
            HERE / "topology.yaml", method=method, out_dir=HERE / "runs" / method, quiet=True
        )
        if run.code != 0:
            raise SystemExit(f"{method}: the swarm failed (exit {run.code}): runs/{method}/logs")
        finals = {row["node"]: row for row in run.records}  # ordered by round: the last stays
        table[method] = {
            "mae": {n: round(r["test_mae"], 2) for n, r in finals.items()},
            "rmse": {n: round(r["test_rmse"], 2) for n, r in finals.items()},
            "mae_mean": round(run.summary["metrics"]["test_mae"]["mean"], 2),
            "rmse_mean": round(run.summary["metrics"]["test_rmse"]["mean"], 2),
        }
        mean = table[method]
        print(f"{method:9} test MAE {mean['mae_mean']:6.2f}  RMSE {mean['rmse_mean']:6.2f}")
    (HERE / "results.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
