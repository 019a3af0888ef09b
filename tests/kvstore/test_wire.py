"""The parameter server's wire format: round trips, and every way a message can be bad."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from hora.kvstore.ps import wire
from hora.kvstore.ps.wire import Cmd, WireError

KEY = b"job secret"
PUSH = {"c": int(Cmd.PUSH), "s": "w0", "d": "s0", "i": 7, "a": 3, "k": "weight", "seq": 1, "off": 0, "n": 6,
        "z": -1}


SIX = np.arange(6, dtype=np.float32)


def frames_of(header=PUSH, arrays=(SIX,), key=KEY) -> list[bytes]:
    return [f if isinstance(f, bytes) else bytes(wire.bytes_view(f)) for f in wire.encode(header, arrays, key)]


def resign(frames: list[bytes], key=KEY) -> list[bytes]:
    body = frames[:-1]
    return [*body, wire._mac(key, body[0], [wire.payload_digest(f) for f in body[1:]])]


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES))
def test_round_trip_keeps_dtype_shape_and_values(dtype):
    a = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    msg = wire.decode(frames_of({**PUSH, "c": int(Cmd.REPLY), "e": ""}, (a, a[0, 0])), KEY)
    assert msg.cmd is Cmd.REPLY and msg["i"] == 7
    assert [x.dtype for x in msg.arrays] == [a.dtype, a.dtype]
    np.testing.assert_array_equal(msg.arrays[0], a)
    np.testing.assert_array_equal(msg.arrays[1], a[0, 0])


def test_zero_size_and_zero_dim_arrays():
    msg = wire.decode(frames_of({**PUSH, "c": int(Cmd.REPLY), "e": ""}, (np.zeros((0, 3)), np.array(5))), KEY)
    assert msg.arrays[0].shape == (0, 3) and msg.arrays[1].shape == () and msg.arrays[1] == 5


def test_receive_is_zero_copy_and_writable():
    zmq = pytest.importorskip("zmq")
    frames = [zmq.Frame(f) for f in frames_of()]
    msg = wire.decode(frames, KEY)
    assert np.shares_memory(msg.arrays[0], np.frombuffer(frames[1].buffer, np.uint8))
    assert msg.arrays[0].flags.writeable


def test_large_frames_hash_as_a_tree_and_verify():
    big = np.random.default_rng(0).standard_normal(3 * wire.CHUNK // 8 + 5)  # several chunks
    assert wire.payload_digest(big) != wire.payload_digest(big[:-1])
    msg = wire.decode(frames_of(arrays=(big,)), KEY)
    np.testing.assert_array_equal(msg.arrays[0], big)
    frames = frames_of(arrays=(big,))
    tampered = bytearray(frames[1])
    tampered[wire.CHUNK + 3] ^= 1
    with pytest.raises(WireError, match="HMAC"):
        wire.decode([frames[0], bytes(tampered), frames[2]], KEY)


def test_precomputed_digests_are_used():
    a = np.arange(4.0)
    assert wire.encode(PUSH, (a,), KEY, [wire.payload_digest(a)])[-1] == wire.encode(PUSH, (a,), KEY)[-1]


def test_unsupported_dtype_cannot_be_sent():
    with pytest.raises(ValueError, match="cannot be sent"):
        wire.encode(PUSH, (np.zeros(2, np.complex64),), KEY)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_any_flipped_bit_fails_the_mac(index):
    frames = [bytearray(f) for f in frames_of()]
    frames[index][len(frames[index]) // 2] ^= 0x10
    with pytest.raises(WireError, match="HMAC"):
        wire.decode([bytes(f) for f in frames], KEY)


def test_other_secret_fails_the_mac():
    with pytest.raises(WireError, match="HMAC"):
        wire.decode(frames_of(), b"another secret")


@pytest.mark.parametrize("mutate,match", [
    (lambda f: f[:1], "frames"),
    (lambda f: [], "frames"),
    (lambda f: [f[0], f[2]], "HMAC"),
    (lambda f: [*f[:2], f[2][:31]], "MAC frame"),
    (lambda f: resign([f[0], f[2]]), "header describes 1 arrays but 0"),
    (lambda f: resign([f[0], f[1], f[1], f[2]]), "header describes 1 arrays but 2"),
    (lambda f: resign([f[0], f[1][:-4], f[2]]), "needs 24"),
    (lambda f: resign([b"\xc1", f[2]]), "not msgpack"),
    (lambda f: resign([msgpack.packb([1, 2]), f[2]]), "not a map"),
    (lambda f: resign([msgpack.packb({**PUSH, "c": 99}), f[2]]), "unknown command"),
    (lambda f: resign([msgpack.packb({**PUSH, "c": "PUSH"}), f[2]]), "unknown command"),
    (lambda f: resign([msgpack.packb({1: 2}), f[2]]), "not msgpack"),
], ids=["one-frame", "empty", "dropped-payload", "short-mac", "signed-missing-payload", "signed-extra-payload",
        "size-mismatch", "bad-msgpack", "not-a-map", "unknown-command", "command-as-string", "int-map-keys"])
def test_malformed_messages_are_rejected(mutate, match):
    with pytest.raises(WireError, match=match):
        wire.decode(mutate(frames_of()), KEY)


@pytest.mark.parametrize("field,value", [
    ("k", 3), ("i", "7"), ("i", True), ("z", 0.5), ("a", None), ("s", 1), ("d", b"s0"), ("i", 2**63),
])
def test_wrong_field_types_are_rejected(field, value):
    header = msgpack.packb({**PUSH, field: value, "f": [["float32", [6]]]})
    with pytest.raises(WireError, match=f"'{field}'"):
        wire.decode(resign([header, np.arange(6, dtype=np.float32).tobytes(), b""]), KEY)


def test_missing_field_is_rejected():
    header = {k: v for k, v in PUSH.items() if k != "k"}
    with pytest.raises(WireError, match="missing field 'k'"):
        wire.decode(frames_of(header), KEY)


@pytest.mark.parametrize("desc,match", [
    ([["object", [6]]], "unsupported dtype"), ([["float32", [-6]]], "malformed"), ([["float32", [7]]], "needs 28"),
    ([["float32", [1] * 40]], "malformed"), ([["float32"]], "malformed"), ("float32", "header describes"),
    ([["float32", [True] * 6]], "malformed"), ([[4, [6]]], "malformed"),
])
def test_bad_array_descriptions_are_rejected(desc, match):
    header = msgpack.packb({**PUSH, "f": desc})
    with pytest.raises(WireError, match=match):
        wire.decode(resign([header, np.arange(6, dtype=np.float32).tobytes(), b""]), KEY)


def test_wrong_array_count_for_the_command():
    with pytest.raises(WireError, match="expected 1"):
        wire.decode(frames_of(arrays=(np.zeros(2), np.zeros(2))), KEY)
    with pytest.raises(WireError, match="expected 0"):
        wire.decode(frames_of({"c": int(Cmd.PULL), "s": "w0", "d": "s0", "i": 1, "a": 1, "k": "x", "after": 0,
                               "off": 0, "len": 2, "n": 2},
                              (np.zeros(2),)), KEY)


def test_no_header_is_parsed_before_its_mac_verifies(monkeypatch):
    """A large hostile header with a bad MAC costs a hash, never a msgpack decode (issue 19)."""
    def unpack(*args, **kwargs):
        raise AssertionError("msgpack.unpackb ran on an unauthenticated header")

    header = msgpack.packb(list(range(1_000_000)))
    monkeypatch.setattr(wire.msgpack, "unpackb", unpack)
    with pytest.raises(WireError, match="bad HMAC"):
        wire.decode([header, b"\0" * wire.MAC_BYTES], KEY)
    assert not hasattr(wire, "peek_cmd")


def test_too_many_arrays_cannot_be_sent_or_received():
    with pytest.raises(ValueError, match="at most"):
        wire.encode({"c": int(Cmd.REPLY), "s": "s0", "d": "w0", "i": 1, "e": ""},
                    [np.zeros(1)] * (wire.MAX_FRAMES - 1), KEY)
    with pytest.raises(WireError, match="frames"):
        wire.decode([b"h"] * (wire.MAX_FRAMES + 1), KEY)


def test_shared_memory_reference_replaces_the_payload_frame():
    ref = ["hora-ps-segment", 0, 6, "float32"]
    msg = wire.decode(frames_of({**PUSH, "m": ref}, ()), KEY)
    assert msg.arrays == [] and msg["m"] == ref
    reply = wire.decode(frames_of({"c": int(Cmd.REPLY), "s": "s0", "d": "w0", "i": 1, "e": "", "m": ref}, ()), KEY)
    assert reply.arrays == [] and reply["m"] == ref
    with pytest.raises(WireError, match="expected 0"):  # a reference and a payload frame
        wire.decode(frames_of({**PUSH, "m": ref}), KEY)
    with pytest.raises(WireError, match="expected 1"):  # neither
        wire.decode(frames_of(PUSH, ()), KEY)


@pytest.mark.parametrize("header,match", [
    ({**PUSH, "m": 5}, "'m' should be list"),
    ({**PUSH, "m": "segment"}, "'m' should be list"),
    ({"c": int(Cmd.PULL), "s": "w0", "d": "s0", "i": 1, "a": 1, "k": "x", "after": 0, "off": 0, "len": 2, "n": 2,
      "m": "yes"}, "'m' should be bool"),
    ({"c": int(Cmd.RELEASE), "s": "w0", "d": "s0", "r": 3}, "'r' should be list"),
    ({"c": int(Cmd.RELEASE), "s": "w0", "d": "s0"}, "missing field 'r'"),
])
def test_optional_and_shared_memory_fields_are_typed(header, match):
    arrays = (SIX,) if header.get("c") == Cmd.PUSH else ()
    with pytest.raises(WireError, match=match):
        wire.decode(frames_of(header, arrays), KEY)
