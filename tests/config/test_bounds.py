"""p2pfl.config.bounds: the arithmetic of the bounds, and the loader's limits on the file
itself (size, text, expanded values)."""

from __future__ import annotations

import pytest

from p2pfl.check.load import load_topology, load_yaml
from p2pfl.config import bounds as B
from p2pfl.errors import ConfigError


def test_expanded_size_counts_shared_references_again_and_stops_at_the_limit():
    leaf = [1, 2, 3]
    assert B.expanded_size({"a": leaf, "b": leaf}) == 1 + 2 + 2 * (1 + 3)
    bomb: list = ["x"] * 10
    for _ in range(9):  # 10^10 values once expanded
        bomb = [bomb] * 10
    assert B.expanded_size(bomb, limit=1000) == 1001


def test_generated_edges_and_their_bound():
    assert B.generated_edges("full", 2000, None) == 1_999_000
    assert B.generated_edges("random-k", 100, 500) == 100 * 99
    assert B.generated_edges("ring", 10_000, None) == 10_000
    B.check_edges("full", 2000, None)  # the largest full graph within the bound
    with pytest.raises(ValueError, match="edges: full over 2001 nodes"):
        B.check_edges("full", 2001, None)


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        ([], "0 dimensions"),
        ([1, 2, 3, 4, 5], "5 dimensions"),
        ([0, 8], "every dimension"),
        ([1, -8], "every dimension"),
        ([3, 4096, 4096], "values an input"),
    ],
)
def test_input_shape_bounds(shape, why):
    with pytest.raises(ValueError, match=why):
        B.check_input_shape(shape)


def test_input_shape_within_bounds():
    B.check_input_shape([3, 2048, 2048])
    B.check_input_shape([784])


def test_synthetic_data_is_bounded_in_values():
    B.check_synthetic(2000, 1000, [1, 8, 8])
    with pytest.raises(ValueError, match="synthetic_train"):
        B.check_synthetic(9_000_000, 1_000_000, [3, 32, 32])


def test_a_file_above_the_size_bound_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr("p2pfl.check.load.MAX_FILE_BYTES", 1024)
    path = tmp_path / "big.yaml"
    path.write_text("name: x\nnodes: 2\n" + "# padding\n" * 200)
    with pytest.raises(ConfigError, match="larger than"):
        load_yaml(path)


def test_a_count_at_its_bound_loads(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(f"name: x\nnodes: {B.MAX_NODES}\nrounds: {B.MAX_ROUNDS}\nseed: {B.MAX_SEED}\n")
    cfg = load_topology(path)
    assert len(cfg.nodes) == B.MAX_NODES and cfg.rounds == B.MAX_ROUNDS
    path.write_text(f"name: x\nnodes: {B.MAX_NODES + 1}\n")
    with pytest.raises(ConfigError, match=f"{path}: nodes: 10,001 nodes, above the bound"):
        load_topology(path)
