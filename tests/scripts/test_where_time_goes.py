"""The profile digest: py-spy raw stacks of node processes into the README's buckets."""

from __future__ import annotations


def test_node_process_stacks_fall_into_buckets_and_the_launcher_is_left_out(tmp_path, load_script):
    where = load_script("where_time_goes")
    launcher = 'process 1:"python scripts/bench_scale.py"'
    node = f'{launcher};process 2:"python -m p2pfl.cli node c.yaml"'
    profile = tmp_path / "prof.txt"
    profile.write_text(
        "\n".join(
            [
                f"{launcher};PssSampler.run (bench_startup.py:80) 40",  # the launcher: ignored
                f"{node};_worker (concurrent/futures/thread.py:9);train_local (p2pfl/learning/train.py:5) 30",
                f"{node};Ledger.save_checkpoint (p2pfl/services/ledger.py:1);"
                "Checkpoint.take (p2pfl/services/checkpoint.py:2);"
                "config_fingerprint (p2pfl/services/checkpoint.py:3) 10",
                f"{node};Node._load (p2pfl/node/daemon.py:1);check_model (p2pfl/check/preflight.py:2) 5",
                f"{node};Handle._run (asyncio/events.py:1) 5",
                # an import inside a round's training: its own bucket, not training's
                f"{node};train_local (p2pfl/learning/train.py:5);make_optimizer (x.py:1);"
                "_find_and_load (<frozen importlib._bootstrap>:1) 10",
            ]
        )
    )
    res = where.where(profile, rate=10.0)
    assert res["training"] == {"cpu_s": 3.0, "share": 0.5}
    assert res["training: imports"]["cpu_s"] == 1.0
    assert res["checkpoint: fingerprint"]["cpu_s"] == 1.0  # before the state copy around it
    assert res["start-up: checks (check_model/check_topology)"]["cpu_s"] == 0.5
    assert res["other (event loop, asyncio)"]["cpu_s"] == 0.5
    assert res["total"]["cpu_s"] == 6.0
