"""PFedC's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.pfedc`, docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard
from p2pfl.config.bounds import MAX_METHOD_ITERATIONS, MAX_SAMPLES

# CIFAR-100's coarse label (one of its 20 superclasses) of each fine class 0..99, from the
# dataset's own metadata
CIFAR100_COARSE = (
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11,
    6, 11, 5, 10, 7, 6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5,
    5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13,
    16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
)  # fmt: skip
GROUP_PRESETS = {
    "cifar100-superclasses": [
        [c for c, coarse in enumerate(CIFAR100_COARSE) if coarse == s] for s in range(20)
    ],
}


class PFedCParams(CentralizedParams):
    groups: list[list[int]] | None = Field(
        None,
        description="null: T = C binary 'is class c' heads; a partition of the class ids "
        "into T groups, one softmax head per group; or a preset name "
        f"({', '.join(GROUP_PRESETS)})",
    )

    @field_validator("groups", mode="before")
    @classmethod
    def _preset(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v not in GROUP_PRESETS:
                raise ValueError(f"unknown groups preset {v!r}; known: {', '.join(GROUP_PRESETS)}")
            return GROUP_PRESETS[v]
        return v

    weighting: Literal["mgda", "equal"] = Field(
        "mgda", description="task weights λ: MGDA-UB min-norm (paper) or 1 / #tasks"
    )
    mgda_iters: int = Field(
        25,
        ge=0,
        le=MAX_METHOD_ITERATIONS,
        description="Frank–Wolfe iterations of the MGDA-UB solver",
    )
    mgda_normalization: Literal["none", "l2", "loss", "loss+"] = Field(
        "loss+",
        description="scale of each task gradient before the min-norm solve (Sener & Koltun's "
        "code: ‖g‖, L, or L·‖g‖)",
    )
    presence_min: int = Field(
        1,
        ge=1,
        le=MAX_SAMPLES,
        description="training samples of a task's class(es) a node needs for π = 1",
    )
    train_absent: bool = Field(
        False,
        description="not the paper: also train binary heads of absent classes (negatives only)",
    )


CARD = MethodCard(
    name="pfedc",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=PFedCParams,
    summary="conflict-aware personalized FL with task-wise disentangled classifier heads",
    implementation="p2pfl.algorithms.pfedc:PFedC",
)
