"""The topology's ``dataset:`` section: which data each node learns on, and how the swarm's
data is split between the nodes.

A dataset is a built-in one (:data:`BUILTIN_DATASETS`), a device's own files
(:data:`FILE_DATASETS`, with ``partition: none``) or a user function named by its import
path (:func:`is_import_path`, which the ``model:`` section uses for a user factory too).
The partition spec's grammar is :data:`PARTITION_RE`, which :mod:`p2pfl.learning.partition`
parses again to draw the split. This module checks each field alone and the synthetic
data's size; whether the files open and the partition fits the data is
:mod:`p2pfl.check.preflight`'s. A sibling of :mod:`p2pfl.config.schema`, which holds it as
``TopologyConfig.dataset``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from p2pfl.config import bounds as B
from p2pfl.config.strict import StrictModel
from p2pfl.config.suggest import with_suggestion

PARTITION_RE = re.compile(
    r"^(?:(?P<none>none)|(?P<iid>iid)|dirichlet\((?P<alpha>[0-9.eE+-]+)\)|pathological\((?P<k>\d+)\)"
    r"|(?P<groups>groups)(?:\((?P<g>\d+)\s*,\s*(?P<dom>\d+)\s*,\s*(?P<frac>[0-9.]+)\))?)$"
)


BUILTIN_DATASETS = (
    "fashionmnist",
    "mnist",
    "cifar10",
    "cifar100",
    "svhn",
    "imagefolder",
    "synthetic",
)
# the built-in datasets a reader may fetch when ``download: true`` (never by default)
DOWNLOADABLE = ("fashionmnist", "mnist", "cifar10", "cifar100", "svhn")
FILE_DATASETS = ("csv", "parquet", "npz")  # a device's own files, read by pandas / numpy
IMPORT_PATH_RE = re.compile(
    r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*$"
)
"""``package.module:attribute``: a user's own dataset function or model factory."""


def is_import_path(name: str) -> bool:
    """Whether ``name`` is a ``package.module:attribute`` path (a user's own code)."""
    return IMPORT_PATH_RE.match(name) is not None


def builtin_or_import_path(
    name: str, builtins: tuple[str, ...], what: str, attribute: str = "function"
) -> str:
    """``name`` when it is one of ``builtins`` or a user's ``package.module:attribute``;
    ``ValueError`` otherwise: ``unknown <what> 'x' (did you mean …): one of …, or
    'package.module:<attribute>'``."""
    if name in builtins or is_import_path(name):
        return name
    unknown = with_suggestion(f"unknown {what} {name!r}", name, builtins)
    raise ValueError(f"{unknown}: one of {', '.join(builtins)}, or 'package.module:{attribute}'")


class DatasetConfig(StrictModel):
    name: str = Field(
        "synthetic",
        description="a built-in dataset, a device's own files (csv, parquet, npz), or a "
        "user function 'package.module:function'",
    )
    root: str | None = Field(
        None,
        description="directory with the dataset, or a zip / ImageFolder directory, or the "
        "node's own file; '{id}' is replaced by the node id (data/{id}.csv)",
    )
    download: bool = False
    partition: str = Field(
        "dirichlet(0.5)",
        description="none: each node trains and tests on everything at its own data root",
    )
    min_samples: int = Field(
        10, ge=1, le=B.MAX_SAMPLES, description="Dirichlet: minimum train samples per node"
    )
    train_per_node: int | None = Field(
        None, ge=1, le=B.MAX_SAMPLES, description="cap on each node's train samples"
    )
    test_per_node: int | None = Field(
        None,
        ge=1,
        le=B.MAX_SAMPLES,
        description="each node's test samples (default: same ratio as global)",
    )
    # a device's own data (partition: none)
    label: str | list[str] = Field(
        "label",
        min_length=1,
        description="csv / parquet: the label column, or the columns of value labels "
        "(e.g. [event, time] for a survival loss)",
    )
    targets: Literal["classes", "values"] | None = Field(
        None,
        description="what the labels are: classes (indices into dataset.classes) or values "
        "(numbers to predict); default: from training.loss (values for mse, mae, and a "
        "user's loss without dataset.classes)",
    )
    classes: int | list[str] | None = Field(
        None,
        description="the swarm's label space: a count (labels 0..C-1) or the class names "
        "(labels are names, or their indices); needed for a device's own data",
    )
    test_root: str | None = Field(
        None,
        description="csv / parquet own data: the node's test file ('{id}' is replaced by "
        "the node id; relative to the topology); default: the test file beside the train "
        "file in a folder (test.csv), else the test_fraction of the train file",
    )
    test_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="own data without a test split: this fraction of it (deterministic)",
    )
    test_split: Literal["random", "row_hash"] = Field(
        "random",
        description="own csv / parquet data without a test file: the test_fraction drawn at "
        "random by the seed and node (random), or the rows whose content hashes into it "
        "(row_hash: a row stays on its side as the file grows, as a watched binding needs)",
    )
    stats: str | None = Field(
        None,
        description="csv / parquet: a JSON file of feature normalisation statistics "
        "({mean: {col: v}, std: {col: v}}); default: from the node's own train split",
    )
    # synthetic only
    num_classes: int = Field(10, ge=2, le=B.MAX_CLASSES)
    input_shape: list[int] = Field(default_factory=lambda: [1, 8, 8])
    synthetic_train: int = Field(
        2000, ge=10, le=B.MAX_SYNTHETIC, description="synthetic: total train samples"
    )
    synthetic_test: int = Field(
        1000, ge=10, le=B.MAX_SYNTHETIC, description="synthetic: total test samples"
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        return builtin_or_import_path(v, (*BUILTIN_DATASETS, *FILE_DATASETS), "dataset")

    @field_validator("classes", mode="before")
    @classmethod
    def _numbers_as_names(cls, v: Any) -> Any:
        """Whole numbers among the class names are names (``classes: [0, 1]``: the classes
        named ``"0"`` and ``"1"``, which integer labels name:
        :func:`p2pfl.learning.own_rules.label_indices`)."""
        if not isinstance(v, list):
            return v
        out = []
        for c in v:
            if isinstance(c, bool):
                raise ValueError("classes: a class name is a string or a whole number, not a bool")
            if isinstance(c, float) and c.is_integer():
                c = int(c)
            out.append(str(c) if isinstance(c, int) else c)
        return out

    @field_validator("classes")
    @classmethod
    def _check_classes(cls, v: int | list[str] | None) -> int | list[str] | None:
        if isinstance(v, bool):
            raise ValueError("classes must be a count or a list of class names")
        if isinstance(v, int) and v < 2:
            raise ValueError("classes: a count must be at least 2")
        n = v if isinstance(v, int) else len(v or ())
        if n > B.MAX_CLASSES:
            raise ValueError(f"classes: {n} classes, above the bound of {B.MAX_CLASSES}")
        if isinstance(v, list):
            if len(v) < 2:
                raise ValueError("classes: at least 2 class names")
            dup = sorted({c for c in v if v.count(c) > 1})
            if dup:
                raise ValueError(f"classes: duplicate names {dup}")
        return v

    @field_validator("input_shape")
    @classmethod
    def _check_input_shape(cls, v: list[int]) -> list[int]:
        B.check_input_shape(v)
        return v

    @model_validator(mode="after")
    def _check_test_root(self) -> DatasetConfig:
        if self.test_root is not None and (
            self.name not in ("csv", "parquet") or self.partition != "none"
        ):
            raise ValueError(
                "test_root: a node's own test file, for name csv or parquet with partition: none"
            )
        return self

    @model_validator(mode="after")
    def _check_synthetic_size(self) -> DatasetConfig:
        if self.name == "synthetic":
            B.check_synthetic(self.synthetic_train, self.synthetic_test, self.input_shape)
        return self

    @property
    def own_data(self) -> bool:
        """Whether each node reads its own data root whole (``partition: none``)."""
        return self.partition == "none"

    @property
    def class_names(self) -> list[str] | None:
        """``classes`` as names (a count gives ``"0".."C-1"``), None when not set."""
        if self.classes is None:
            return None
        if isinstance(self.classes, int):
            return [str(i) for i in range(self.classes)]
        return list(self.classes)

    def with_root(self, root: str | None) -> DatasetConfig:
        """This config with ``root`` in place of ``dataset.root`` (a device's ``data_root``);
        itself when ``root`` is None."""
        return self if root is None else self.model_copy(update={"root": root})

    def test_root_for(self, node_id: str) -> str | None:
        """``test_root`` with ``{id}`` replaced by ``node_id``; None when not set."""
        return None if self.test_root is None else self.test_root.replace("{id}", node_id)

    def root_for(self, node_id: str, root: str | None = None) -> str | None:
        """``root`` (default ``self.root``) with ``{id}`` replaced by ``node_id``."""
        r = self.root if root is None else root
        return None if r is None else r.replace("{id}", node_id)

    @field_validator("partition")
    @classmethod
    def _check_partition(cls, v: str) -> str:
        v = v.strip().replace(" ", "")
        m = PARTITION_RE.match(v)
        if not m:
            raise ValueError(
                "partition must be one of none, iid, dirichlet(ALPHA), pathological(K), groups, "
                f"groups(G,DOMINANT,FRACTION); got {v!r}"
            )
        if m["alpha"] is not None:
            try:
                alpha = float(m["alpha"])
            except ValueError:
                raise ValueError(f"{v}: ALPHA must be a number") from None
            if not alpha > 0 or alpha == float("inf"):
                raise ValueError(f"{v}: the Dirichlet concentration ALPHA must be > 0")
        if m["k"] is not None and int(m["k"]) < 1:
            raise ValueError(f"{v}: K (classes per node) must be >= 1")
        if m["k"] is not None and int(m["k"]) > B.MAX_CLASSES:
            raise ValueError(f"{v}: K (classes per node) must be <= {B.MAX_CLASSES}")
        if m["g"] is not None:
            if int(m["g"]) < 1 or int(m["dom"]) < 1:
                raise ValueError(f"{v}: G (groups) and DOMINANT (classes) must be >= 1")
            if int(m["g"]) > B.MAX_NODES or int(m["dom"]) > B.MAX_CLASSES:
                raise ValueError(
                    f"{v}: G (groups) must be <= {B.MAX_NODES}, DOMINANT (classes) "
                    f"<= {B.MAX_CLASSES}"
                )
            try:
                frac = float(m["frac"])
            except ValueError:
                raise ValueError(f"{v}: FRACTION must be a number") from None
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"{v}: FRACTION must be in [0, 1]")
        return v
