"""The topology's ``privacy:`` section: differential privacy (``privacy.dp``) and secure
aggregation (``privacy.secagg``), as pydantic models. A sibling of
:mod:`p2pfl.config.schema`, which holds it as ``TopologyConfig.privacy``; the checks that
need the whole topology (a method's kind, the swarm's size) are the schema's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from p2pfl.config import bounds as B
from p2pfl.config.strict import StrictModel

MAX_PHYSICAL_BATCH = 128  # over twice training.batch_size's default (50): a Poisson batch of
# that rate exceeds it with probability < 1e-20, so such runs train in one chunk, bit for bit
# as before the bound existed (the Fashion-MNIST CNN holds ~0.85 GB of them at 128)


class DPConfig(StrictModel):
    """Differential privacy on every node (docs/algorithms.md, "Differential privacy"), at
    one of two levels. ``sample`` (the default): DP-SGD, Poisson-sampled batches, each
    sample's gradient clipped to ``max_grad_norm``, Gaussian noise of standard deviation
    ``noise_multiplier · max_grad_norm`` per step, and an accountant that composes every
    step of the node's rounds into one (ε, ``delta``). ``update``: node-level DP on what
    leaves the node, each round's whole update (the trained model minus the model before
    training) clipped to ``max_update_norm`` with Gaussian noise of standard deviation
    ``noise_multiplier · max_update_norm`` added, and one Gaussian release a round composed
    with dp-accounting. Give ``noise_multiplier`` or ``target_epsilon``, exactly one."""

    level: Literal["sample", "update"] = Field(
        "sample",
        description="sample: DP-SGD (record-level, each step's gradients); update: "
        "node-level DP on each round's outgoing update (clipped and noised once a round)",
    )
    noise_multiplier: float | None = Field(
        None, gt=0, description="σ: the noise's standard deviation over the clipping bound"
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="or: the ε the node may spend over the run; σ is planned once for "
        "`rounds` rounds, and the node stops training when a round would exceed it",
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="level sample: C, each sample's gradient bound"
    )
    max_update_norm: float = Field(
        1.0,
        gt=0,
        description="level update: C, the bound on the L2 norm of a round's whole update "
        "(every floating tensor of the model, as one vector)",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the (ε, δ) guarantee")
    accountant: Literal["rdp", "prv", "analytic"] = Field(
        "rdp",
        description="how the noise composes: rdp, Rényi DP (both levels: Opacus's for "
        "sample, dp-accounting's for update); prv (level sample: Opacus's privacy random "
        "variables); analytic (level update: the exact ε of the composed Gaussian releases)",
    )
    rounds: int | None = Field(
        None,
        ge=1,
        le=B.MAX_ROUNDS,
        description="target_epsilon: the rounds σ is planned for (default: the run's rounds)",
    )
    max_physical_batch: int = Field(
        MAX_PHYSICAL_BATCH,
        ge=1,
        le=B.MAX_BATCH_SIZE,
        description="level sample: the most samples whose per-sample gradients are held at "
        "once; a larger Poisson batch is clipped and summed in chunks of this size into one "
        "noisy step (memory only: the batch, the noise and ε are the same)",
    )
    secret_noise: bool = Field(
        False,
        description="draw the noise (and, level sample, the batches) from a seed the node "
        "keeps to itself (os.urandom) instead of the swarm's seed: whoever knows the "
        "topology cannot regenerate the noise, and runs are not reproducible (for deployments)",
    )

    # these validators run only on fields a config sets (not on defaults): a bound of the
    # other level is refused rather than silently unused
    @field_validator("max_grad_norm")
    @classmethod
    def _grad_norm_is_dp_sgd(cls, v: float, info: ValidationInfo) -> float:
        if info.data.get("level") == "update":
            raise ValueError(
                "DP-SGD's per-sample bound, unused under level: update (whose bound is "
                "max_update_norm)"
            )
        return v

    @field_validator("max_physical_batch")
    @classmethod
    def _physical_batch_is_dp_sgd(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("level") == "update":
            raise ValueError(
                "DP-SGD's per-sample gradient memory bound, unused under level: update "
                "(which trains without per-sample gradients)"
            )
        return v

    @field_validator("max_update_norm")
    @classmethod
    def _update_norm_is_update(cls, v: float, info: ValidationInfo) -> float:
        if info.data.get("level") == "sample":
            raise ValueError("the bound of level: update, unused by DP-SGD (level: sample)")
        return v

    @field_validator("accountant")
    @classmethod
    def _accountant_of_level(cls, v: str, info: ValidationInfo) -> str:
        level = info.data.get("level")
        if level == "update" and v == "prv":
            raise ValueError(
                "prv is Opacus's DP-SGD accountant; level: update composes its Gaussian "
                "releases with dp-accounting: rdp or analytic"
            )
        if level == "sample" and v == "analytic":
            raise ValueError(
                "analytic composes level: update's Gaussian releases; DP-SGD takes rdp or prv"
            )
        return v

    @model_serializer(mode="wrap")
    def _level_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumps hold the bound of the config's level only, so they load again (the other
        is refused when set); DP-SGD's dump is as before levels existed (no ``level``), and
        as before ``max_physical_batch`` existed while it is the default."""
        data = handler(self)
        data.pop("max_grad_norm" if self.level == "update" else "max_update_norm", None)
        if self.level == "update" or self.max_physical_batch == MAX_PHYSICAL_BATCH:
            data.pop("max_physical_batch", None)  # the default: the dump as before it existed
        if self.level == "sample":
            data.pop("level", None)
        return data

    @model_validator(mode="after")
    def _one_noise(self) -> DPConfig:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give noise_multiplier or target_epsilon (exactly one of them)")
        if self.rounds is not None and self.target_epsilon is None:
            raise ValueError("rounds: only with target_epsilon (it plans σ for that budget)")
        return self


class PrivacyConfig(StrictModel):
    """Privacy protections of the swarm (none by default)."""

    dp: DPConfig | None = Field(
        None, description="differential privacy on every node: DP-SGD, or on its outgoing updates"
    )
    secagg: bool = Field(
        False,
        description="secure aggregation (SecAgg+) on the rotating aggregator of fedavg and "
        "fedper: the aggregator learns only the sum of the uploads (docs/design.md, "
        '"Secure aggregation")',
    )
    secagg_neighbours: int | None = Field(
        None,
        ge=2,
        le=B.MAX_NODES,
        description="secagg: each member's masking and share neighbours, the SecAgg+ "
        "degree k (rounded up to even; none: every other member)",
    )
    secagg_threshold: float = Field(
        0.6,
        gt=0,
        le=1,
        description="secagg: the shares needed to unmask, as a fraction of a neighbourhood "
        "of k (clamped into floor(k/2) < t <= k)",
    )

    @model_serializer(mode="wrap")
    def _secagg_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without secure aggregation the dump (and so a run's fingerprint) is as before it
        existed: no ``secagg*`` field."""
        data = handler(self)
        if not self.secagg:
            for name in ("secagg", "secagg_neighbours", "secagg_threshold"):
                data.pop(name, None)
        return data
