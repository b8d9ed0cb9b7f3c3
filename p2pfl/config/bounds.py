"""Upper bounds on what a topology may ask for: every count that allocates, loops or waits.

A bound here is far above what any real swarm uses (``bench_scale`` runs 1,000 nodes) and
well below what exhausts a machine: ``nodes: 100000000`` is refused with a message naming
the field, instead of building a hundred million node specs until ``MemoryError``. The
schema (:mod:`p2pfl.config.schema`) and the methods' knobs cite these constants in their
``le=`` constraints, so a value above one is reported like any other bad value: the file,
the field, the bound and the value given. A topology file itself is bounded in bytes and,
after YAML's anchors and aliases are expanded, in values (:func:`expanded_size`).

Pure constants and arithmetic: this module imports nothing of p2pfl.
"""

from __future__ import annotations

from typing import Any

MAX_NODES = 10_000
"""``nodes`` (a count or a list), and every count of nodes or peers (``edges.k``,
``defence.f``/``m``, ``privacy.secagg_neighbours``, a method's peers or clusters)."""

MAX_EDGES = 2_000_000
"""Edges of the graph, listed or generated: ``full`` and ``erdos`` enumerate every pair
(n(n-1)/2), ``random-k`` draws n·k."""

MAX_ROUNDS = 1_000_000
"""``rounds`` and every count of rounds (``privacy.dp.rounds``, ``timing.max_staleness``,
``defence.distrust_rounds``, an attack's rounds)."""

MAX_EPOCHS = 10_000
"""``training.epochs``: local epochs a round."""

MAX_MIN_STEPS = 1_000_000
"""``training.min_steps``: optimizer steps a round when ``training.epochs`` is unset."""

MAX_BATCH_SIZE = 1 << 20
"""``training.batch_size``."""

MAX_THREADS = 1024
"""``training.threads`` (and a node file's ``threads``)."""

MAX_HIDDEN = 1 << 16
"""``model.hidden``: the MLP's hidden units."""

MAX_CLASSES = 100_000
"""``dataset.classes``, ``dataset.num_classes``, a partition's classes per node."""

MAX_SAMPLES = 1_000_000_000
"""Per-node sample counts: ``dataset.train_per_node``, ``test_per_node``, ``min_samples``."""

MAX_SYNTHETIC = 10_000_000
"""``dataset.synthetic_train`` and ``synthetic_test``: samples generated in memory."""

MAX_INPUT_DIMS = 4
"""``dataset.input_shape``: at most this many dimensions (channels, then spatial)."""

MAX_INPUT_SIZE = 1 << 16
"""``dataset.input_shape``: each dimension."""

MAX_INPUT_ELEMENTS = 1 << 24
"""``dataset.input_shape``: the values of one input (3 × 2,048 × 2,048 fits)."""

MAX_SYNTHETIC_ELEMENTS = 1 << 29
"""Synthetic data: (``synthetic_train`` + ``synthetic_test``) × the input's values
(2 GiB of float32)."""

MAX_SECONDS = 10_000_000.0
"""Every duration in seconds (timeouts, linger, delays): about 115 days."""

MAX_MESSAGE_MB = 100.0
"""``max_message_mb``: the launcher's broker accepts packets of twice this, and MQTT caps a
packet at 256 MiB."""

MAX_TRANSFER_MB = float(1 << 20)
"""``max_transfer_mb``: 1 TiB."""

MAX_SEED = (1 << 32) - 1
"""``seed``: every seeding API accepts it (NumPy's legacy seeds stop at 2³² − 1)."""

MAX_CLAIM = 1 << 62
"""``attacks[].claim``: a sample count the wire's integers carry."""

MAX_METHOD_ITERATIONS = 100_000
"""A method's solver iterations a round (e.g. pFedC's ``mgda_iters``)."""

MAX_FILE_BYTES = 64 << 20
"""A topology or node file: 64 MiB (a listed graph of ``MAX_EDGES`` edges fits)."""

MAX_VALUES = 10_000_000
"""Values of a topology file once YAML's aliases are expanded (a "billion laughs" file is
a few lines that expand to billions)."""


def expanded_size(data: Any, limit: int = MAX_VALUES) -> int:
    """How many values ``data`` holds with every shared reference counted again (as
    validation and dumping will visit them), counting up to ``limit + 1`` and stopping
    there, so an alias bomb costs ``limit`` steps, not its expansion."""
    count = 0
    stack = [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return count


def generated_edges(kind: str, n: int, k: int | None) -> int:
    """The most edges ``edges: {kind}`` enumerates for ``n`` nodes (``k``: random-k's)."""
    if kind in ("full", "erdos"):
        return n * (n - 1) // 2
    if kind == "random-k":
        return n * min(k or 1, max(n - 1, 0))
    return n  # ring, line, star


def check_edges(kind: str, n: int, k: int | None) -> None:
    """``ValueError`` (``edges: ...``) when ``edges: {kind}`` over ``n`` nodes would
    enumerate more than :data:`MAX_EDGES` edges."""
    count = generated_edges(kind, n, k)
    if count > MAX_EDGES:
        raise ValueError(
            f"edges: {kind} over {n} nodes enumerates {count:,} edges, above the bound of "
            f"{MAX_EDGES:,}; use a sparser graph (ring, random-k with a smaller k)"
        )


def check_input_shape(shape: list[int]) -> None:
    """``ValueError`` unless ``shape`` has 1 to :data:`MAX_INPUT_DIMS` dimensions, each in
    1..:data:`MAX_INPUT_SIZE`, and at most :data:`MAX_INPUT_ELEMENTS` values."""
    if not 1 <= len(shape) <= MAX_INPUT_DIMS:
        raise ValueError(f"{len(shape)} dimensions: give 1 to {MAX_INPUT_DIMS}, e.g. [1, 8, 8]")
    bad = [d for d in shape if not 1 <= d <= MAX_INPUT_SIZE]
    if bad:
        raise ValueError(f"{shape}: every dimension must be in 1..{MAX_INPUT_SIZE}")
    total = _product(shape)
    if total > MAX_INPUT_ELEMENTS:
        raise ValueError(
            f"{shape}: {total:,} values an input, above the bound of {MAX_INPUT_ELEMENTS:,}"
        )


def check_synthetic(train: int, test: int, shape: list[int]) -> None:
    """``ValueError`` (``synthetic_train: ...``) when synthetic data of ``train + test``
    samples of ``shape`` would hold more than :data:`MAX_SYNTHETIC_ELEMENTS` values."""
    values = (train + test) * _product(shape)
    if values > MAX_SYNTHETIC_ELEMENTS:
        raise ValueError(
            f"synthetic_train: {train + test:,} samples of shape {shape} are {values:,} "
            f"values, above the bound of {MAX_SYNTHETIC_ELEMENTS:,}"
        )


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
