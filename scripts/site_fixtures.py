"""The data binding a small federation of sites serves in the site wing's scripts
(``soak_federation.py``, ``bench_site_boundary.py``) and its tests
(``tests/sites/daemon_helpers.py``): the synthetic dataset, split among the sites by a
Dirichlet partition, small enough that a round takes a second on a busy machine."""

from __future__ import annotations

from typing import Any

SYNTHETIC_BINDING: dict[str, Any] = {
    "name": "synthetic",
    "partition": "dirichlet(0.5)",
    "num_classes": 4,
    "input_shape": [1, 8, 8],
    "synthetic_train": 600,
    "synthetic_test": 300,
}
