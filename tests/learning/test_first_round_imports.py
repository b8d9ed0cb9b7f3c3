"""A node's first round imports nothing: what torch imports the first time an optimizer is
built is imported once the node is ready, before round 1
(:func:`p2pfl.learning.train.load_optimizer_machinery`), so that no round's training time
(stretched by ``1 / speed`` on an emulated slower device) carries an import."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_training_after_the_warm_up_imports_no_module() -> None:
    # a fresh interpreter: this test process may have imported anything already
    code = textwrap.dedent(
        """
        import sys
        import torch
        from p2pfl.config.learning_schema import TrainingConfig
        from p2pfl.learning.train import load_optimizer_machinery, train_local

        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
        x, y = torch.randn(40, 1, 4, 4), torch.randint(0, 2, (40,))
        cfg = TrainingConfig(epochs=1, batch_size=8, optimizer="adam", lr=0.01)
        before_warm_up = set(sys.modules)
        load_optimizer_machinery()
        warmed = set(sys.modules)
        train_local(model, x, y, cfg, 0.01)
        print(len(warmed - before_warm_up), sorted(set(sys.modules) - warmed))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split(maxsplit=1)
    warm_up_imported, trained_imported = int(out[0]), out[1].strip()
    assert warm_up_imported > 0  # the warm-up is what imports them
    assert trained_imported == "[]"
