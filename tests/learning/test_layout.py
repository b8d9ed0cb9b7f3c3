"""The model layout nodes announce (p2pfl/learning/layout.py): its fingerprint, the first
difference between two layouts in words, and untrusted layouts parsed without raising."""

from __future__ import annotations

import torch

from p2pfl.learning.layout import describe_layout, layout_difference, parse_layout, summary


def state(hidden: int = 4, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        "g.fc.weight": torch.zeros(hidden, 3, dtype=dtype),
        "g.fc.bias": torch.zeros(hidden, dtype=dtype),
        "h.out.weight": torch.zeros(2, hidden, dtype=dtype),
    }


def test_the_fingerprint_ignores_order_and_sees_every_field():
    a = describe_layout(state(), (3,), 2)
    shuffled = dict(reversed(list(state().items())))
    assert describe_layout(shuffled, (3,), 2)["fp"] == a["fp"]
    assert describe_layout(state(5), (3,), 2)["fp"] != a["fp"]
    assert describe_layout(state(), (4,), 2)["fp"] != a["fp"]
    assert describe_layout(state(), (3,), 3)["fp"] != a["fp"]
    assert a["tensors"][0] == ["g.fc.weight", [4, 3], "float32"]


def test_the_first_difference_in_words():
    mine = describe_layout(state(), (3,), 2)
    assert layout_difference(mine, describe_layout(state(), (3,), 2)) is None
    assert layout_difference(mine, describe_layout(state(), (5,), 2)) == (
        "input shape [3] here, [5] there"
    )
    assert layout_difference(mine, describe_layout(state(), (3,), 4)) == "2 classes here, 4 there"
    assert layout_difference(mine, describe_layout(state(7), (3,), 2)) == (
        "tensor 'g.fc.weight': [4, 3] float32 here, [7, 3] float32 there"
    )
    half = describe_layout(state(dtype=torch.float16), (3,), 2)
    assert "float32 here, [4, 3] float16 there" in layout_difference(mine, half)
    fewer = {k: v for k, v in state().items() if k != "g.fc.bias"}
    assert layout_difference(mine, describe_layout(fewer, (3,), 2)) == (
        "tensor 'g.fc.bias' [4] float32 here, absent there"
    )
    assert layout_difference(describe_layout(fewer, (3,), 2), mine) == (
        "tensor 'g.fc.bias' [4] float32 there, absent here"
    )
    assert "(input [3], 2 classes, 3 tensors, 24 values)" in summary(mine)


def test_untrusted_layouts_are_parsed_or_refused_never_raised():
    good = describe_layout(state(), (3,), 2)
    assert parse_layout(good) == good
    for bad in (
        None,
        "layout",
        {**good, "fp": 1},
        {**good, "input_shape": [3, "x"]},
        {**good, "num_classes": True},
        {**good, "tensors": [["g.fc.weight", [4, 3.5], "float32"]]},
        {**good, "tensors": [["g.fc.weight", [4, 3]]]},
        {**good, "tensors": "many"},
    ):
        assert parse_layout(bad) is None, bad
