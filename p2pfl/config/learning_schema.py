"""The topology's sections on what a node learns with: ``model:`` (a built-in model and its
knobs, or the user's own module, its split into the shared part ``g`` and the personal part
``h``, and a warm start) and ``training:`` (the optimizer, its steps a round and whether it is
kept across rounds). A sibling of :mod:`p2pfl.config.schema`, which holds them as
``TopologyConfig.model`` and ``.training`` and re-exports their names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from p2pfl.config import bounds as B
from p2pfl.config.dataset_schema import builtin_or_import_path, is_import_path
from p2pfl.config.strict import StrictModel

BUILTIN_LOSSES = ("cross_entropy", "bce", "mse", "mae")
"""``training.loss``'s names: softmax cross-entropy over one logit a class, binary
cross-entropy of one logit, and the squared and absolute errors of predicted values."""

BUILTIN_METRICS = ("accuracy", "balanced_accuracy", "auc", "f1", "mae", "rmse", "c_index")
"""``evaluation.metrics``' names (:mod:`p2pfl.learning.task`)."""

CLASS_METRICS = ("accuracy", "balanced_accuracy", "auc", "f1")
"""The metrics of class labels; ``mae``, ``rmse`` and ``c_index`` score values."""

BUILTIN_MODELS = ("cnn", "lenet", "mlp", "resnet18", "vgg11")
MODEL_KNOBS: dict[str, tuple[str, ...]] = {"cnn": ("padding", "head"), "mlp": ("hidden",)}
"""The ``model:`` fields each built-in model reads (p2pfl.learning.models.build_model)."""


class ModelConfig(StrictModel):
    name: str = Field(
        "cnn",
        description="a built-in model, or 'package.module:factory' returning any "
        "torch.nn.Module, called with num_classes and input_shape (and kwargs)",
    )
    personal: list[str] | None = Field(
        None,
        description="parameter-name prefixes of the personal part h (the rest is g); "
        "default: the last nn.Linear; [] keeps nothing personal. Built-in models have their "
        "own split",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="more keyword arguments for a user factory"
    )
    init: str | None = Field(
        None,
        description="a device's field: a safetensors file of this very model (p2pfl export, "
        "a site's kept model) the node starts from instead of the swarm's common initial "
        "model, its personal part included (a warm start)",
    )
    hidden: int = Field(64, ge=1, le=B.MAX_HIDDEN, description="mlp: hidden units")
    padding: Literal["same", "valid"] = Field(
        "same",
        description="cnn: 'same' pads its 5x5 convolutions by 2 (McMahan et al.'s CNN, 4,096 "
        "features on 32x32 inputs); 'valid' pads none (the personalized-FL literature's CIFAR "
        "CNN, 1,600 features)",
    )
    head: Literal["fc", "last"] = Field(
        "fc",
        description="cnn: the personal part h is both FC layers ('fc', UA-PDFL's split: the "
        "convolutions are g) or only the last one ('last': g = convolutions + FC 512)",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        return builtin_or_import_path(v, BUILTIN_MODELS, "model", "factory")

    @property
    def is_user(self) -> bool:
        """Whether the model is the user's own (a factory's import path)."""
        return is_import_path(self.name)

    def applicable(self) -> dict[str, Any]:
        """The fields that shape this model, as JSON-able data (a trained model's
        ``model.json``): ``name``, and for a user model ``personal`` and ``kwargs``, for a
        built-in one its own knobs (:data:`MODEL_KNOBS`) only; the rest would not change
        the model. :meth:`model_validate` of it gives back an equal model."""
        data = self.model_dump(mode="json")
        keep = ("personal", "kwargs") if self.is_user else MODEL_KNOBS.get(self.name, ())
        return {"name": data["name"], **{k: data[k] for k in keep}}

    @model_validator(mode="after")
    def _check_personal(self) -> ModelConfig:
        if self.personal is not None and not self.is_user:
            raise ValueError("personal: only for a user model ('package.module:factory')")
        if self.personal is not None and any(not p.strip() for p in self.personal):
            raise ValueError("personal: a prefix is empty ([] keeps nothing personal)")
        if self.kwargs and not self.is_user:
            raise ValueError("kwargs: only for a user model ('package.module:factory')")
        return self


class TrainingConfig(StrictModel):
    """How a node trains each round. ``steps`` set: exactly that many optimizer steps, over
    as many shuffled epochs as they take (the last one cut short); ``epochs`` set: exactly
    that many epochs; neither: as many whole epochs as reach ``min_steps`` optimizer steps
    (:func:`p2pfl.learning.train.round_epochs`), so that a node with a few dozen rows still
    learns. ``optimizer_state``: ``reset`` makes the optimizer anew each round (the papers'
    simulations), ``keep`` carries its state (Adam's moments, SGD's momentum) from round to
    round, per node, through a resume."""

    epochs: int | None = Field(
        None,
        ge=1,
        le=B.MAX_EPOCHS,
        description="local epochs a round (default: the fewest whole epochs that reach "
        "min_steps optimizer steps; one epoch wherever a node has min_steps batches)",
    )
    min_steps: int = Field(
        20,
        ge=1,
        le=B.MAX_MIN_STEPS,
        description="where epochs and steps are unset: the least optimizer steps a round",
    )
    steps: int | None = Field(
        None,
        ge=1,
        le=B.MAX_MIN_STEPS,
        description="exactly this many optimizer steps a round, epochs cut where they fall "
        "(instead of epochs)",
    )
    batch_size: int = Field(50, ge=1, le=B.MAX_BATCH_SIZE)
    loss: str = Field(
        "cross_entropy",
        description="cross_entropy (logits, one a class), bce (one logit, two classes), "
        "mse or mae (values), or 'package.module:function' (outputs, labels) -> loss",
    )
    optimizer: Literal["sgd", "adam"] = "sgd"
    optimizer_state: Literal["keep", "reset"] = Field(
        "reset",
        description="reset: a new optimizer each round; keep: its state (Adam's moments, "
        "momentum) carried across rounds, per node, through a resume",
    )
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr multiplier per round")
    device: str = "cpu"
    threads: int = Field(1, ge=1, le=B.MAX_THREADS, description="torch threads per node process")

    @field_validator("loss")
    @classmethod
    def _check_loss(cls, v: str) -> str:
        return builtin_or_import_path(v, BUILTIN_LOSSES, "loss")

    @property
    def value_loss(self) -> bool:
        """Whether the built-in loss trains on values (``mse``, ``mae``) rather than classes;
        a user's loss takes either (``dataset.targets``)."""
        return self.loss in ("mse", "mae")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("steps: give epochs or steps a round, not both")
        return self


class EvaluationConfig(StrictModel):
    """What every round's evaluation on a node's test split reports (:mod:`p2pfl.learning.task`).
    ``metrics`` unset: ``accuracy`` for class labels, ``mae`` and ``rmse`` for values (none
    for a user's loss on values: its loss alone)."""

    metrics: list[str] | None = Field(
        None,
        max_length=16,
        description="accuracy, balanced_accuracy, auc, f1 (classes), mae, rmse, c_index "
        "(values; c_index: the risk score against labels [event, time]), or "
        "'package.module:function' (outputs, labels) -> float; each in every record as "
        "test_<name> (accuracy: test_acc)",
    )

    @field_validator("metrics")
    @classmethod
    def _check_metrics(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for name in v:
            builtin_or_import_path(name, BUILTIN_METRICS, "metric")
        dup = sorted({n for n in v if v.count(n) > 1})
        if dup:
            raise ValueError(f"metrics: {dup} listed twice")
        return v
