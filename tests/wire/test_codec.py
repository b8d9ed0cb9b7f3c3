"""p2pfl.wire.codec: exact round trips, and every kind of bad input is a CodecError."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import torch

from p2pfl.wire.codec import (
    ALLOWED_DTYPES,
    MAX_DEPTH,
    CodecError,
    buffer_to_state,
    decode,
    encode,
    state_nbytes,
    state_to_buffer,
)

BIG = 1 << 24


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def tensor_map(dtype="float32", shape=(2,), data=b"\0" * 8, **extra):
    return {"__tensor__": 1, "dtype": dtype, "shape": list(shape), "data": data, **extra}


def raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (3, 4, 5)])
def test_roundtrip_every_dtype_and_shape(name, shape):
    t = sample(ALLOWED_DTYPES[name], shape)
    msg = {"outer": [{"t": t, "n": 1}, [t, "s"]], "t": t}
    out = decode(encode(msg), BIG)
    assert same(out["t"], t)
    assert same(out["outer"][0]["t"], t)
    assert same(out["outer"][1][0], t)
    assert out["outer"][0]["n"] == 1 and out["outer"][1][1] == "s"


def test_roundtrip_plain_values():
    msg = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63)],
        "float": 1.5,
        "str": "héllo",
        "bytes": b"\x00\xff",
        "tuple": (1, 2),
        "empty": {},
        "np_scalar": np.float32(2.5),
    }
    out = decode(encode(msg), BIG)
    assert out["tuple"] == [1, 2] and out["np_scalar"] == 2.5
    for k in ("none", "bools", "ints", "float", "str", "bytes", "empty"):
        assert out[k] == msg[k]


def test_decoded_tensors_are_writable_and_independent():
    t = torch.arange(4, dtype=torch.float32)
    out = decode(encode({"t": t}), BIG)["t"]
    out += 1  # no warning, no error: backed by a bytearray
    assert torch.equal(t, torch.arange(4, dtype=torch.float32))


def test_noncontiguous_and_grad_tensors():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    w = torch.ones(3, requires_grad=True)
    out = decode(encode([t, w]), BIG)
    assert same(out[0], t.contiguous())
    assert same(out[1], w.detach())


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
)
def test_numpy_arrays_decode_as_tensors(dtype):
    a = sample(ALLOWED_DTYPES[dtype], (3, 2)).numpy()
    out = decode(encode({"a": a, "f": np.asfortranarray(a), "z": a[:0]}), BIG)
    np.testing.assert_array_equal(out["a"].numpy(), a)
    np.testing.assert_array_equal(out["f"].numpy(), a)
    assert out["z"].shape == (0, 2)


def test_numpy_big_endian_and_0d():
    a = np.arange(5, dtype=">i4")
    out = decode(encode([a, np.array(3.25)]), BIG)
    assert out[0].dtype == torch.int32 and out[0].tolist() == [0, 1, 2, 3, 4]
    assert out[1].shape == () and out[1].item() == 3.25


def test_encode_rejects_unsupported():
    with pytest.raises(CodecError, match="dtype"):
        encode(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(CodecError, match="dtype"):
        encode(np.zeros(2, dtype=np.complex64))
    with pytest.raises(CodecError, match="set"):
        encode({"x": {1, 2}})
    with pytest.raises(CodecError):
        encode(2**70)


def test_decode_accepts_bytearray_and_memoryview():
    data = encode({"t": torch.arange(3)})
    for buf in (bytearray(data), memoryview(data), memoryview(bytearray(data))):
        assert torch.equal(decode(buf, BIG)["t"], torch.arange(3))


# ----------------------------------------------------------------------------- bad input


def test_oversized():
    data = encode({"x": b"a" * 100})
    decode(data, len(data))
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode(data, len(data) - 1)


def test_truncated_at_every_length():
    data = encode({"t": torch.arange(10), "s": "abc", "l": [1, 2, 3]})
    for n in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:n], BIG)
    with pytest.raises(CodecError, match="truncated"):
        decode(data[:-1], BIG)


def test_trailing_garbage():
    with pytest.raises(CodecError, match="trailing"):
        decode(encode({"a": 1}) + b"\x00", BIG)


def test_not_msgpack_and_empty():
    with pytest.raises(CodecError):
        decode(b"", BIG)
    with pytest.raises(CodecError):
        decode(b"\xc1", BIG)
    with pytest.raises(CodecError):
        decode("text", BIG)  # type: ignore[arg-type]


def test_ext_types_rejected():
    with pytest.raises(CodecError, match="ext"):
        decode(raw(msgpack.ExtType(5, b"abc")), BIG)
    with pytest.raises(CodecError):
        decode(raw({"ts": msgpack.Timestamp(1, 0)}), BIG)


def test_nesting_limit():
    def nested(depth):
        obj: list = []
        for _ in range(depth - 1):
            obj = [obj]
        return obj

    decode(raw(nested(MAX_DEPTH)), BIG)
    with pytest.raises(CodecError, match="deeper"):
        decode(raw(nested(MAX_DEPTH + 1)), BIG)
    with pytest.raises(CodecError):
        decode(b"\x91" * 5000 + b"\xc0", BIG)  # beyond msgpack's own stack


def test_non_str_map_keys_rejected():
    with pytest.raises(CodecError):
        decode(raw({1: 2}), BIG)


def test_invalid_utf8():
    with pytest.raises(CodecError, match="UTF-8"):
        decode(b"\xa2\xff\xfe", BIG)


@pytest.mark.parametrize(
    "bad, match",
    [
        (tensor_map(data=b"\0" * 7), "bytes"),
        (tensor_map(data=b"\0" * 9), "bytes"),
        (tensor_map(shape=(3,)), "bytes"),
        (tensor_map(dtype="complex64"), "dtype"),
        (tensor_map(dtype="object"), "dtype"),
        (tensor_map(dtype=5), "dtype"),
        (tensor_map(shape=(-2,), data=b""), "range"),
        (tensor_map(shape=(2**62, 2**62), data=b""), "range"),
        (tensor_map(shape=[1] * 40, data=b"\0" * 4), "dimensions"),
        (tensor_map(shape=(2.0,)), "ints"),
        (tensor_map(shape=(True, 2)), "ints"),
        ({**tensor_map(), "shape": "2"}, "list"),
        (tensor_map(data="x" * 8), "bin"),
        (tensor_map(extra=1), "keys"),
        ({"__tensor__": 1, "dtype": "float32", "shape": [1]}, "keys"),
        ({**tensor_map(), "__tensor__": 2}, "version"),
        (tensor_map(dtype="bool", shape=(2,), data=b"\x01\x02"), "bool"),
    ],
)
def test_bad_tensor_maps(bad, match):
    with pytest.raises(CodecError, match=match):
        decode(raw({"x": [bad]}), BIG)


def test_random_garbage_never_raises_anything_else():
    rng = random.Random(1234)
    good = encode({"t": torch.arange(6, dtype=torch.float32), "s": "x", "l": [1, {"a": None}]})
    decoded = 0
    for i in range(500):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:  # mutate a valid message: closer to the format, reaches deeper code paths
            data = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        try:
            decode(data, 4096)
            decoded += 1
        except CodecError:
            pass
    assert 0 < decoded < 500


# ----------------------------------------------------------------------------- states


def make_state() -> dict[str, torch.Tensor]:
    state = {}
    for i, name in enumerate(sorted(ALLOWED_DTYPES)):
        dtype = ALLOWED_DTYPES[name]
        state[f"{name}.w"] = sample(dtype, (3, 5), seed=i)
        state[f"{name}.scalar"] = sample(dtype, (), seed=i + 100)
        state[f"{name}.empty"] = sample(dtype, (0, 4), seed=i)
    state["odd.1"] = torch.ones(1, dtype=torch.int8)
    state["transposed"] = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    return state


def test_state_roundtrip_exact():
    state = make_state()
    index, buf = state_to_buffer(state)
    assert isinstance(buf, bytearray)
    assert [e["name"] for e in index] == list(state)
    assert sum(e["nbytes"] for e in index) == state_nbytes(state)
    out = buffer_to_state(index, buf)
    assert list(out) == list(state)
    for k in state:
        assert same(out[k], state[k].contiguous()), k
    # the index survives the wire
    index2 = decode(encode(index), BIG)
    out2 = buffer_to_state(index2, bytearray(buf))
    assert all(same(out2[k], out[k]) for k in state)


def test_state_is_zero_copy_over_buffer():
    index, buf = state_to_buffer({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)})
    out = buffer_to_state(index, buf)
    out["a"][0] = 1.0
    assert buf[index[0]["offset"] : index[0]["offset"] + 4] == bytearray(np.float32(1.0).tobytes())
    del buf  # tensors keep the buffer alive
    assert out["a"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_state_accepts_numpy_and_empty_state():
    index, buf = state_to_buffer({"a": np.arange(3, dtype=np.int16)})
    assert buffer_to_state(index, buf)["a"].tolist() == [0, 1, 2]
    index, buf = state_to_buffer({})
    assert index == [] and len(buf) == 0 and buffer_to_state(index, buf) == {}


def test_state_to_buffer_rejects_bad_states():
    with pytest.raises(CodecError):
        state_to_buffer({"a": [1, 2]})
    with pytest.raises(CodecError):
        state_to_buffer({"a": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(CodecError):
        state_to_buffer({1: torch.zeros(2)})  # type: ignore[dict-item]


def test_overlapping_ranges_are_allowed():
    buf = bytearray(16)
    index = [
        {"name": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16},
        {"name": "b", "dtype": "int32", "shape": [2], "offset": 8, "nbytes": 8},
    ]
    out = buffer_to_state(index, buf)
    assert out["a"].shape == (4,) and out["b"].shape == (2,)


def _entry(**kw):
    e = {"name": "w", "dtype": "float32", "shape": [2, 2], "offset": 0, "nbytes": 16}
    e.update(kw)
    return e


@pytest.mark.parametrize(
    "index, match",
    [
        ([_entry(offset=8)], "outside"),
        ([_entry(offset=2**70)], "outside"),
        ([_entry(shape=[4, 4], nbytes=64)], "outside"),
        ([_entry(offset=-4)], "offset"),
        ([_entry(offset=2, shape=[1], nbytes=4)], "aligned"),
        ([_entry(offset=True)], "offset"),
        ([_entry(nbytes=12)], "nbytes"),
        ([_entry(nbytes=-16)], "nbytes"),
        ([_entry(dtype="complex64")], "dtype"),
        ([_entry(shape=[-2, -2])], "range"),
        ([_entry(shape="22")], "list"),
        ([_entry(name=3)], "name"),
        ([_entry(), _entry(shape=[2], nbytes=8)], "duplicate"),
        ([_entry(extra=1)], "keys"),
        ([{"name": "w"}], "keys"),
        (["w"], "map"),
        ({"w": _entry()}, "list"),
        ([_entry(dtype="bool", shape=[2], nbytes=2)], "bool"),
    ],
)
def test_bad_index(index, match):
    buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
    buf[0] = 7  # not a valid bool
    with pytest.raises(CodecError, match=match):
        buffer_to_state(index, buf)


def test_buffer_must_be_writable():
    with pytest.raises(CodecError):
        buffer_to_state([], b"")  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        buffer_to_state([], memoryview(b"abc"))  # type: ignore[arg-type]
    assert buffer_to_state([_entry(shape=[1], nbytes=4)], memoryview(bytearray(4)))["w"].shape == (
        1,
    )


def test_state_nbytes():
    assert state_nbytes({"a": torch.zeros(3, 2), "b": np.zeros(4, np.int8), "c": 5}) == 28


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors():
    state = {
        "a": torch.randn(3, 4, device="cuda"),
        "b": torch.arange(5, device="cuda").to(torch.bfloat16),
    }
    out = decode(encode(state), BIG)
    index, buf = state_to_buffer(state)
    out2 = buffer_to_state(index, buf)
    for k, v in state.items():
        assert same(out[k], v.cpu()) and same(out2[k], v.cpu())
