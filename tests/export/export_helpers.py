"""A run directory made by hand the way a run leaves it: ``config.yaml`` (the resolved
topology) and, per node, ``nodes/<id>.safetensors`` + ``nodes/<id>.model.json`` of a model
built like the swarm's and trained a little."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.build import build_node_model
from p2pfl.check.load import load_topology
from p2pfl.config.schema import TopologyConfig, dump_topology
from p2pfl.learning.artifacts import write_model_artifacts


@dataclass
class Run:
    dir: Path
    cfg: TopologyConfig
    models: dict[str, nn.Module]  # node id → the trained module written for it
    info: dict[str, Any]  # what write_model_artifacts was given (the same for every node)


def train_a_bit(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, seed: int):
    """A few SGD steps on random data: weights unlike the initial model's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, *input_shape, generator=gen)
    y = torch.randint(0, num_classes, (32,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()


def make_run(
    root: Path,
    *,
    model: str = "mlp",
    input_shape: tuple[int, ...] = (1, 8, 8),
    num_classes: int = 4,
    classes: list[str] | None = None,
    input_spec: dict[str, Any] | None = None,
    algorithm: str | None = None,
    nodes: tuple[str, ...] = ("a", "b"),
    overrides: list[str] | None = None,
    prepare=None,
) -> Run:
    sets = [
        f"model.name={model}",
        f"dataset.num_classes={num_classes}",
        f"dataset.input_shape={list(input_shape)}",
    ]
    if algorithm:
        sets += [f"algorithm.name={algorithm}", "algorithm.params={}"]
    cfg = load_topology("topologies/synthetic.yaml", sets + (overrides or []))
    run = root / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_topology(cfg))
    cls = get_algorithm(cfg.algorithm.name)
    info = {
        "model": cfg.model.applicable(),
        "algorithm": cfg.algorithm.name,
        "num_classes": num_classes,
        "input_shape": list(input_shape),
        "classes": classes,
        "input_spec": input_spec,
        "round": cfg.rounds,
    }
    models = {}
    for i, nid in enumerate(nodes):
        split = build_node_model(cls, cfg, num_classes, input_shape)
        train_a_bit(split, input_shape, num_classes, seed=i)
        if prepare is not None:
            prepare(split)
        module = split.export_module()
        write_model_artifacts(run, nid, module, info)
        models[nid] = module
    return Run(run, cfg, models, info)


# a tabular model's inputs: three features normalised by these statistics, three classes
FEATURES = ["age", "bmi", "bp"]
CLASSES = ["low", "mid", "high"]
SPEC = {
    "kind": "tabular",
    "features": FEATURES,
    "label": "risk",
    "mean": [50, 25, 90],
    "std": [10, 4, 12],
}


def two_tabular_runs(root: Path, input_spec: dict[str, Any], classes: list[str]) -> tuple[Run, Run]:
    """Two runs of a tabular MLP (its ``input_spec`` features) whose node ``a`` models
    differ: in the second, ``a`` is trained from another seed."""
    n_in, kw = len(input_spec["features"]), {"num_classes": len(classes), "classes": classes}
    first = make_run(root / "r1", input_shape=(n_in,), input_spec=input_spec, **kw)
    second = make_run(
        root / "r2", input_shape=(n_in,), input_spec=input_spec, nodes=("b", "a"), **kw
    )
    return first, second
