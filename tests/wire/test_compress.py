"""p2pfl.wire.compress: round trips within each codec's bound (exact for none), the wire
form through the transfer codec, top-k's stream with error feedback, and hostile compressed
states refused with CompressError."""

from __future__ import annotations

import math

import pytest
import torch

from p2pfl.learning.admission import admit_state, nonfinite_key
from p2pfl.wire.codec import encode, state_nbytes, state_to_buffer
from p2pfl.wire.compress import (
    HEADER,
    CompressError,
    Spec,
    TopKReceiver,
    TopKSender,
    codec_for,
    decode_state,
    encode_state,
    is_compressed,
    parse_spec,
    topk_positions,
)
from p2pfl.wire.transfers import PreparedState

LIMIT = 1 << 24
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "g.conv.weight": torch.randn(8, 3, 3, 3, generator=g) * 0.3,
        "g.conv.bias": torch.randn(8, generator=g).double(),
        "g.bn.num_batches_tracked": torch.tensor(17),
        "g.mask": torch.rand(5, generator=g) > 0.5,
        "g.empty": torch.empty(0, 4),
        "h.fc.weight": (torch.randn(4, 16, generator=g) * 5).half(),
        "h.fc.bias": torch.randn(4, generator=g).bfloat16(),
        "h.ids": torch.arange(6, dtype=torch.int32).view(2, 3),
        "h.scalar": torch.tensor(2.5),
    }


def through_transfer(wire) -> dict[str, torch.Tensor]:
    """``wire`` as a receiver gets it: packed into one buffer and laid back over it."""
    prepared = PreparedState.from_state(wire)
    from p2pfl.wire.codec import buffer_to_state

    return buffer_to_state(prepared.index, prepared.buf)


def wire_bytes(wire) -> int:
    return len(state_to_buffer(wire)[1])


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype at each of its values (as float64)."""
    x = t.to(torch.float64).abs()
    eps = torch.finfo(t.dtype).eps
    tiny = torch.finfo(t.dtype).tiny * eps
    return torch.clamp(x * eps, min=tiny)


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("none", Spec("none")),
        ("fp16", Spec("fp16")),
        ("int8", Spec("int8")),
        ("topk(0.1)", Spec("topk", 0.1)),
        ("topk(.25)", Spec("topk", 0.25)),
        ("topk(1)", Spec("topk", 1.0)),
        ("topk(1.00)", Spec("topk", 1.0)),
    ],
)
def test_specs_parse(spec, parsed):
    assert parse_spec(spec) == parsed
    assert parse_spec(str(parsed)) == parsed


@pytest.mark.parametrize("spec", ["", "int4", "topk(0)", "topk(0.0)", "topk(2)", "TOPK(.1)", 3])
def test_bad_specs_are_refused(spec):
    with pytest.raises(CompressError):
        parse_spec(spec)


def test_topk_has_no_stateless_codec():
    with pytest.raises(CompressError, match="stream"):
        encode_state(sample_state(), "topk(0.1)")


# ----------------------------------------------------------------------------- none


def test_none_is_the_state_itself_byte_for_byte():
    state = sample_state()
    assert encode_state(state, "none") is state
    assert decode_state(state, max_bytes=LIMIT) is state
    assert not is_compressed(state)
    plain = PreparedState.from_state(state, "xxh3_128")
    named = PreparedState.from_state(state, "xxh3_128", "none")
    index, buf = state_to_buffer(state)
    assert named.buf == plain.buf == buf and named.index == plain.index == index
    assert named.hexdigest == plain.hexdigest


# ----------------------------------------------------------------------------- fp16 / int8


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_round_trip_keeps_names_order_shapes_and_dtypes(mode):
    state = sample_state()
    got = decode_state(through_transfer(encode_state(state, mode)), max_bytes=LIMIT)
    assert list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        if not v.is_floating_point():
            assert torch.equal(got[k], v), k  # non-floating tensors travel untouched
    assert codec_for(mode).decode(encode_state(state, mode), max_bytes=LIMIT).keys() == state.keys()


def test_fp16_error_bound_and_untouched_half_types():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0**e for e in range(-8, 5)])
    state = {"a": x, "b": x.double(), "h": x.half(), "bf": x.bfloat16()}
    wire = encode_state(state, "fp16")
    got = decode_state(through_transfer(wire), max_bytes=LIMIT)
    for k in ("a", "b"):
        err = (got[k].double() - state[k].double()).abs()
        bound = torch.clamp(state[k].double().abs() * 2.0**-11, min=2.0**-25)
        assert bool((err <= bound).all()), k
    assert torch.equal(got["h"], state["h"]) and torch.equal(got["bf"], state["bf"])
    assert wire_bytes(wire) < 0.6 * wire_bytes(state)


def test_fp16_sends_raw_what_float16_cannot_hold():
    big = torch.tensor([1.0, 70000.0, -3.0])
    got = decode_state(encode_state({"a": big}, "fp16"), max_bytes=LIMIT)
    assert torch.equal(got["a"], big)  # not turned into an infinity


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_error_bound(dtype):
    g = torch.Generator().manual_seed(2)
    for x in (
        torch.randn(50, 40, generator=g) * 3 + 1,
        torch.rand(1000, generator=g) * 1e-3,  # all positive, tiny range
        torch.randn(7, generator=g) * 1e4,
    ):
        x = x.to(dtype)
        got = decode_state(through_transfer(encode_state({"x": x}, "int8")), max_bytes=LIMIT)["x"]
        assert got.dtype == dtype and got.shape == x.shape
        x64 = x.double()
        s = (float(x64.max()) - float(x64.min())) / 255
        err = (got.double() - x64).abs()
        bound = s / 2 * (1 + 1e-9) + ulp(got) / 2
        assert bool((err <= bound).all()), (dtype, float((err - bound).max()))
        assert float(got.double().min()) == pytest.approx(float(x64.min()), abs=float(ulp(x).max()))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [0.0, -1.5, 3.0e-7, 1234.5])
def test_int8_constant_tensor_round_trips_exactly(dtype, value):
    x = torch.full((3, 4), value, dtype=dtype)
    got = decode_state(encode_state({"x": x}, "int8"), max_bytes=LIMIT)["x"]
    assert got.dtype == dtype and torch.equal(got, x)


def test_int8_is_about_a_quarter_of_float32():
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    assert wire_bytes(encode_state(state, "int8")) < 0.27 * wire_bytes(state)


def test_gpu_or_strided_tensors_encode_like_contiguous_ones():
    x = torch.randn(6, 8)
    a = decode_state(encode_state({"x": x.t()}, "int8"), max_bytes=LIMIT)["x"]
    b = decode_state(encode_state({"x": x.t().contiguous()}, "int8"), max_bytes=LIMIT)["x"]
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_non_finite_values_survive_and_admission_refuses_them(mode):
    x = torch.randn(10)
    x[3], x[5], x[7] = float("nan"), float("inf"), float("-inf")
    state = {"g.w": x, "g.ok": torch.randn(4)}
    got = decode_state(through_transfer(encode_state(state, mode)), max_bytes=LIMIT)
    assert torch.isnan(got["g.w"][3]) and got["g.w"][5] == math.inf and got["g.w"][7] == -math.inf
    assert nonfinite_key(got) == "g.w"
    reference = {"g.w": torch.randn(10), "g.ok": torch.randn(4)}
    assert "non-finite" in admit_state(got, reference, 10.0)


def test_a_hostile_int8_scale_decodes_to_infinities_admission_refuses():
    wire = encode_state({"g.w": torch.randn(8)}, "int8")
    forged = forge(wire, lambda h: h["tensors"][0].update(lo=1e38, scale=1e37))
    got = decode_state(forged, max_bytes=LIMIT)  # float32 overflows: inf, not a crash
    assert nonfinite_key(got) == "g.w"


# ----------------------------------------------------------------------------- hostile


def forge(wire, edit=None, header: bytes | None = None, **tensors) -> dict[str, torch.Tensor]:
    """``wire`` with its header edited (``edit`` on the decoded map, or raw ``header``
    bytes) and tensors replaced or added (None removes one)."""
    from p2pfl.wire.codec import decode

    out = dict(wire)
    if edit is not None:
        h = decode(bytes(wire[HEADER].numpy()), LIMIT)
        edit(h)
        header = encode(h)
    if header is not None:
        out[HEADER] = (
            torch.frombuffer(bytearray(header), dtype=torch.uint8)
            if header
            else (torch.empty(0, dtype=torch.uint8))
        )
    for k, v in tensors.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _set(key, value):
    return lambda h: h.__setitem__(key, value)


def _entry(key, value, i=0):
    return lambda h: h["tensors"][i].__setitem__(key, value)


INT8 = encode_state({"g.w": torch.randn(4, 5), "g.n": torch.tensor(3)}, "int8")


@pytest.mark.parametrize(
    "wire, match",
    [
        (forge(INT8, _set("codec", "zstd")), "unknown codec"),
        (forge(INT8, _set("codec", 7)), "unknown codec"),
        (forge(INT8, _set("v", 2)), "version"),
        (forge(INT8, _set("v", True)), "version"),
        (forge(INT8, _set("extra", 1)), "header keys"),
        (forge(INT8, _set("stream", {})), "header keys"),
        (forge(INT8, _set("tensors", {"a": 1})), "list of maps"),
        (forge(INT8, _set("tensors", [1])), "list of maps"),
        (forge(INT8, header=b"\xc1"), "header"),  # not msgpack
        (forge(INT8, header=b"\x92\x01\x02"), "header must be a map"),
        (forge(INT8, header=encode({"v": 1})[:-1] + b"\xda"), "header"),  # truncated
        (forge(INT8, header=b""), "empty header"),
        ({**INT8, HEADER: torch.zeros(2, 2, dtype=torch.uint8)}, "1-D uint8"),
        ({**INT8, HEADER: torch.zeros(4, dtype=torch.int8)}, "1-D uint8"),
        (forge(INT8, _entry("form", "int4")), "form"),
        (forge(INT8, _entry("form", [1])), "form"),
        (forge(INT8, _entry("dtype", ["float32"])), "dtype"),
        (forge(INT8, _entry("name", ["g.w"])), "name"),
        (forge(INT8, _entry("form", "topk")), "form"),
        (forge(INT8, _entry("form", "fp16")), "form"),
        (forge(INT8, _entry("dtype", "complex64")), "dtype"),
        (forge(INT8, _entry("name", HEADER)), "name"),
        (forge(INT8, _entry("name", 5)), "name"),
        (forge(INT8, _entry("name", "g.n")), "repeated name"),
        (forge(INT8, _entry("shape", [4, -5])), "shape"),
        (forge(INT8, _entry("shape", [4, 4])), "shape"),  # 16 levels sent, 20 claimed
        (forge(INT8, _entry("shape", "4x5")), "shape"),
        (forge(INT8, _entry("shape", [1] * 40)), "shape"),
        (forge(INT8, _entry("shape", [1 << 40, 1 << 20])), "exceeds the limit"),
        (forge(INT8, _entry("lo", float("nan"))), "finite"),
        (forge(INT8, _entry("scale", float("inf"))), "finite"),
        (forge(INT8, _entry("scale", -1.0)), "scale >= 0"),
        (forge(INT8, _entry("lo", "0")), "finite"),
        (forge(INT8, _entry("extra", 1)), "keys"),
        (forge(INT8, lambda h: h["tensors"][0].pop("scale")), "keys"),
        (forge(INT8, _entry("form", "int8", 1)), "keys"),  # int64 tensor, no lo/scale
        (forge(INT8, lambda h: h["tensors"][1].update(form="int8", lo=0.0, scale=1.0)), "floating"),
        (forge(INT8, **{"g.w": None}), "entries but"),
        (forge(INT8, **{"g.w": torch.zeros(4, 5, dtype=torch.int8)}), "expected"),
        (forge(INT8, **{"g.w": torch.zeros(19, dtype=torch.uint8)}), "shape"),
        (forge(INT8, **{"g.w": torch.zeros(3, 5, dtype=torch.uint8)}), "shape"),
        (forge(INT8, **{"g.x": torch.zeros(2)}), "no entry describes"),
        (forge(INT8, lambda h: h["tensors"].pop()), "no entry describes"),
        (forge(INT8, lambda h: h["tensors"].append(dict(h["tensors"][1], name="g.z"))), "entries"),
    ],
)
def test_hostile_compressed_states_are_refused(wire, match):
    with pytest.raises(CompressError, match=match):
        decode_state(wire, max_bytes=LIMIT)


def test_a_huge_decoded_size_is_refused_before_allocating():
    x = torch.randn(1000)
    wire = encode_state({"a": x}, "fp16")
    assert decode_state(wire, max_bytes=4000)["a"].shape == (1000,)
    with pytest.raises(CompressError, match="exceeds the limit of 3999"):
        decode_state(wire, max_bytes=3999)  # float32 decoded: 4000 bytes
    big = forge(wire, _entry("shape", [1 << 62]))
    with pytest.raises(CompressError, match="exceeds the limit"):
        decode_state(big, max_bytes=LIMIT)


def test_states_that_are_not_maps_or_tensors_are_refused():
    with pytest.raises(CompressError):
        decode_state([1, 2], max_bytes=LIMIT)
    with pytest.raises(CompressError, match="1-D uint8"):
        decode_state({HEADER: b"\x80"}, max_bytes=LIMIT)
    with pytest.raises(CompressError, match="expected a tensor"):
        encode_state({"a": [1.0]}, "int8")
    with pytest.raises(CompressError, match="reserved"):
        encode_state({HEADER: torch.zeros(1)}, "fp16")
    with pytest.raises(CompressError, match="reserved"):
        encode_state({"a@idx": torch.zeros(1)}, "fp16")


def test_a_header_over_its_limit_is_refused():
    from p2pfl.wire import compress

    wire = forge(INT8, header=b"\x80" * (compress.MAX_HEADER_BYTES + 1))
    with pytest.raises(CompressError, match="exceeds"):
        decode_state(wire, max_bytes=LIMIT)


def test_decoding_never_raises_anything_but_compress_error_on_mangled_headers():
    """Every single-byte corruption of a real header: decoded or a CompressError."""
    raw = bytes(INT8[HEADER].numpy())
    for i in range(len(raw)):
        for b in (0x00, 0xFF, raw[i] ^ 0x01):
            mangled = raw[:i] + bytes([b]) + raw[i + 1 :]
            try:
                decode_state(forge(INT8, header=mangled), max_bytes=LIMIT)
            except CompressError:
                pass


# ----------------------------------------------------------------------------- top-k


def test_topk_positions_are_the_largest_changes_without_zeros():
    change = torch.tensor([0.0, -5.0, 1.0, 0.0, 3.0, -0.5, 0.0, 0.0])
    assert topk_positions(change, 0.25).tolist() == [1, 4]  # ⌈0.25·8⌉ = 2
    assert topk_positions(change, 1.0).tolist() == [1, 2, 4, 5]  # zeros never sent
    assert topk_positions(torch.zeros(3), 0.5).tolist() == []
    assert topk_positions(torch.empty(0), 0.5).tolist() == []
    assert topk_positions(change.view(2, 4), 0.01).tolist() == [1]  # at least one


def walk(steps: int, seed: int = 0, n: int = 400):
    g = torch.Generator().manual_seed(seed)
    x = {"g.w": torch.randn(20, n // 20, generator=g), "h.b": torch.randn(5, generator=g).double()}
    x["g.n"] = torch.tensor(0)
    for t in range(steps):
        yield {k: v.clone() for k, v in x.items()}
        x["g.w"] = x["g.w"] + 0.05 * torch.randn(x["g.w"].shape, generator=g)
        x["h.b"] = x["h.b"] + 0.05 * torch.randn(5, generator=g).double()
        x["g.n"] = torch.tensor(t + 1)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values, bit for bit (NaN equal to NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def same_state(a, b) -> bool:
    return list(a) == list(b) and all(same_tensor(a[k], b[k]) for k in a)


def test_topk_receiver_rebuilds_the_published_estimate_bit_for_bit():
    sender, rx = TopKSender(0.1), TopKReceiver()
    sizes = []
    for x in walk(8):
        sender.publish(x)
        wire = sender.message(rx.base)
        sizes.append(wire_bytes(wire))
        got = rx.apply(through_transfer(wire), max_bytes=LIMIT)
        assert same_state(got, sender.estimate)
        assert rx.base == (sender.epoch, sender.seq)
        assert torch.equal(got["g.n"], x["g.n"])  # non-floating: exact, every time
    assert sizes[0] >= state_nbytes(sender.estimate)  # the first is dense
    assert max(sizes[1:]) < 0.4 * sizes[0]  # then about 10 % of the values and their positions


def test_topk_error_feedback_carries_what_was_not_sent():
    """e_t = x_t - P_t is exactly the unsent part of (x_t - P_{t-1}), and a state that stops
    changing is reached exactly within ⌈1/rho⌉ publishes."""
    sender = TopKSender(0.25)
    states = list(walk(6))
    prev = None
    for x in states:
        sender.publish(x)
        if prev is not None:
            e = sender.error(x)["g.w"]
            before = x["g.w"] - prev
            sent = e == 0
            assert int(sent.sum()) >= math.ceil(0.25 * e.numel())
            # wherever a value was not sent, the residual is the whole of its change
            assert torch.equal(e[~sent], before[~sent])
            # every unsent |change| is no larger than the smallest sent one
            assert float(before[~sent].abs().max()) <= float(before[sent].abs().min())
        prev = sender.estimate["g.w"].clone()
    last = states[-1]
    for _ in range(4):  # 1 / 0.25
        sender.publish(last)
    assert same_state(sender.estimate, last)


def test_topk_residual_stays_bounded_while_the_state_drifts():
    sender = TopKSender(0.1)
    norms = []
    for x in walk(30):
        sender.publish(x)
        norms.append(float(sender.error(x)["g.w"].norm()))
    drift = 0.05 * math.sqrt(400)  # one step's change
    assert max(norms) < 6 * drift  # error feedback: the residual does not grow with t


def test_a_receiver_without_the_base_gets_a_dense_state():
    sender, rx = TopKSender(0.1, window=2), TopKReceiver()
    states = list(walk(6))
    sender.publish(states[0])
    rx.apply(sender.message(None), max_bytes=LIMIT)
    held = rx.base
    for x in states[1:4]:  # the receiver misses three publishes: beyond the window
        sender.publish(x)
    wire = sender.message(held)
    assert wire_bytes(wire) >= state_nbytes(sender.estimate)
    assert same_state(rx.apply(wire, max_bytes=LIMIT), sender.estimate)
    sender.publish(states[4])  # one behind, within the window: a delta again
    wire = sender.message(rx.base)
    assert wire_bytes(wire) < 0.5 * state_nbytes(sender.estimate)
    assert same_state(rx.apply(wire, max_bytes=LIMIT), sender.estimate)
    # a delta spanning two publishes: the union of their positions
    held = rx.base
    sender.publish(states[5])
    sender.publish(states[0])
    assert same_state(rx.apply(sender.message(held), max_bytes=LIMIT), sender.estimate)
    # a restarted sender (new epoch) answers the old base with a dense state
    restarted = TopKSender(0.1)
    restarted.publish(states[5])
    wire = restarted.message(rx.base)
    assert wire_bytes(wire) >= state_nbytes(restarted.estimate)
    assert same_state(rx.apply(wire, max_bytes=LIMIT), restarted.estimate)


def test_a_dense_int8_message_leaves_the_receiver_without_a_base():
    sender, rx = TopKSender(0.1), TopKReceiver()
    x = next(walk(1))
    sender.publish(x)
    wire = sender.message(None, dense="int8")
    got = rx.apply(wire, max_bytes=LIMIT)
    assert rx.base is None and got["g.w"].dtype == torch.float32
    assert float((got["g.w"] - x["g.w"]).abs().max()) < 0.05
    # a node without a stream still decodes a dense top-k message
    assert same_state(decode_state(wire, max_bytes=LIMIT), got)


def test_a_layout_change_starts_a_new_epoch():
    sender = TopKSender(0.5)
    sender.publish({"a": torch.zeros(4)})
    epoch = sender.epoch
    sender.publish({"a": torch.zeros(5)})
    assert sender.epoch != epoch and torch.equal(sender.estimate["a"], torch.zeros(5))


def test_topk_non_finite_tensors_travel_whole():
    sender, rx = TopKSender(0.1), TopKReceiver()
    x = next(walk(1))
    sender.publish(x)
    rx.apply(sender.message(None), max_bytes=LIMIT)
    bad = {k: v.clone() for k, v in x.items()}
    bad["g.w"][0, 0] = float("nan")
    sender.publish(bad)
    got = rx.apply(sender.message(rx.base), max_bytes=LIMIT)
    assert nonfinite_key(got) == "g.w" and same_state(got, sender.estimate)
    good = next(walk(1, seed=3))
    sender.publish(good)  # back to finite: its previous estimate was not, so whole again
    got = rx.apply(sender.message(rx.base), max_bytes=LIMIT)
    assert same_state(got, sender.estimate) and torch.equal(got["g.w"], good["g.w"])


def test_hostile_topk_messages_are_refused():
    sender, rx = TopKSender(0.2), TopKReceiver()
    states = list(walk(2))
    sender.publish(states[0])
    rx.apply(sender.message(None), max_bytes=LIMIT)
    sender.publish(states[1])
    delta = sender.message(rx.base)
    assert "g.w@idx" in delta
    with pytest.raises(CompressError, match="needs the stream's base"):
        decode_state(delta, max_bytes=LIMIT)
    with pytest.raises(CompressError, match="holds None"):
        TopKReceiver().apply(delta, max_bytes=LIMIT)
    idx = delta["g.w@idx"]
    cases = [
        (forge(delta, **{"g.w@idx": idx.flip(0)}), "increasing"),
        (forge(delta, **{"g.w@idx": idx.clone().fill_(0)}), "increasing"),
        (forge(delta, **{"g.w@idx": idx + 400}), "within"),
        (forge(delta, **{"g.w@idx": idx - 1000}), "within"),
        (forge(delta, **{"g.w@idx": idx.float()}), "expected"),
        (forge(delta, **{"g.w@idx": idx[:-1]}), "positions"),
        (forge(delta, **{"g.w@idx": None}), "missing"),
        (forge(delta, **{"g.w": delta["g.w"].double()}), "expected"),
        (forge(delta, _set("stream", {"epoch": "x", "seq": 2, "base": 1})), "holds"),
        (forge(delta, _set("stream", {"epoch": "", "seq": 2, "base": 1})), "epoch"),
        (forge(delta, _set("stream", {"epoch": sender.epoch, "seq": 1, "base": 2})), "range"),
        (forge(delta, _set("stream", {"epoch": sender.epoch, "seq": 2})), "stream"),
        (forge(delta, lambda h: h.pop("stream")), "stream"),
        (forge(delta, _entry("shape", [400])), "base holds"),
        (forge(INT8, _set("codec", "topk")), "stream"),
    ]
    for wire, match in cases:
        with pytest.raises(CompressError, match=match):
            rx.apply(wire, max_bytes=LIMIT)
        assert rx.base == (sender.epoch, 1)  # a refused message leaves the base as it was
    with pytest.raises(CompressError, match="expected a topk message"):
        rx.apply(INT8, max_bytes=LIMIT)
    assert same_state(rx.apply(delta, max_bytes=LIMIT), sender.estimate)


def test_topk_sender_arguments_are_checked():
    with pytest.raises(CompressError):
        TopKSender(0.0)
    with pytest.raises(CompressError):
        TopKSender(0.5, window=0)
    with pytest.raises(CompressError, match="nothing published"):
        TopKSender(0.5).message(None)
    s = TopKSender(0.5)
    s.publish({"a": torch.zeros(2)})
    with pytest.raises(CompressError, match="dense form"):
        s.message(None, dense="fp8")
