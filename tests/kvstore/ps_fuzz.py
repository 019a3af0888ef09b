"""The fuzz worker: thousands of bad frames at a live server, then proof that nothing changed.

It joins a one-worker job as a real worker, stores known values, and then
opens a second, raw connection to the server (and one to the scheduler),
authenticated at the handshake with the job's credentials as any holder of
the secret could (an outsider does not get this far: see ps_attack.py), to
send forged, truncated and malformed messages: random bytes, flipped bits in
signed messages, missing and extra frames, and correctly signed messages
whose header is garbage, has an unknown command, wrong field types, a bad
dtype or shape, a size that does not match its frame, or a sender that is
not the connection's worker.  Through its own connection it also sends
well-formed requests the server must refuse (wrong dtype or size, unknown
key, a compressed push without compression, bad optimizer specs), and
shared-memory pushes whose header names a segment that is missing, not this
job's, outside ``/dev/shm``, readable by others, or a range outside or
misaligned in a real segment.  Then it pulls every key: each must still hold
exactly its stored value, and a normal push/pull round must work.
"""

from __future__ import annotations

import os
import random

import msgpack
import numpy as np
import zmq

import hora.kvstore as kvs
from hora.errors import PSError
from hora.kvstore.ps import secure, shm, wire
from hora.kvstore.ps.client import SCHEDULER
from hora.kvstore.ps.wire import Cmd

VALUES = {"f32": np.arange(12, dtype=np.float32) * 1.5, "i64": np.arange(5, dtype=np.int64) - 2,
          "f64": np.linspace(-1, 1, 2000)}


def _signed(key: bytes, header: dict, arrays=()) -> list[bytes]:
    return [bytes(wire.bytes_view(f)) if not isinstance(f, bytes) else f
            for f in wire.encode(header, arrays, key)]


def _resign(key: bytes, frames: list[bytes]) -> list[bytes]:
    """Recompute the MAC over (possibly broken) header and payload frames, as a holder of the secret could."""
    body = frames[:-1]
    digests = [wire.payload_digest(f) for f in body[1:]]
    return [*body, wire._mac(key, body[0], digests)]


def bad_messages(key: bytes, me: str, server: str, rng: random.Random) -> list[list[bytes]]:
    """One round of bad messages of every kind (about 60)."""
    push = {"c": int(Cmd.PUSH), "s": me, "d": server, "i": 10**6, "a": 0, "k": "f32", "seq": 1, "off": 0, "n": 12,
            "z": -1}
    good = _signed(key, push, (np.ones(12, np.float32),))
    out: list[list[bytes]] = []
    # random garbage
    for n in range(1, 6):
        out.append([rng.randbytes(rng.randint(0, 64)) for _ in range(n)])
    # a signed message with one flipped bit in each frame, or its MAC cut short
    for i in range(len(good)):
        frames = [bytearray(f) for f in good]
        if frames[i]:
            frames[i][rng.randrange(len(frames[i]))] ^= 1 << rng.randrange(8)
        out.append([bytes(f) for f in frames])
    out.append([*good[:-1], good[-1][:16]])
    # truncated or padded: frames missing or added
    out.append(good[:-1])
    out.append([good[0], good[-1]])
    out.append([good[0], good[1], good[1], good[-1]])
    out.append(_resign(key, [good[0], good[-1]]))             # signed, but the payload frame is missing
    out.append(_resign(key, [good[0], good[1], good[1], b""]))  # signed, one frame too many
    out.append([b"", b""])
    # correctly signed garbage headers
    for header in (b"\xc1", b"\x92\x01", rng.randbytes(40), msgpack.packb([1, 2, 3]), msgpack.packb(7),
                   msgpack.packb({"c": 99, "s": me, "d": server}), msgpack.packb({"c": "PUSH"}),
                   msgpack.packb({1: 2}), msgpack.packb({"c": int(Cmd.PUSH)})):
        out.append(_resign(key, [header, b""]))
    # correctly signed, well-formed msgpack, wrong field types or values
    for field, value in (("k", 5), ("i", "1"), ("i", True), ("z", 1.5), ("a", None), ("s", 3), ("d", b"s0"),
                         ("seq", None), ("off", "0"), ("n", [12]),
                         ("i", 2**64 - 1), ("i", -(2**63) - 0)):
        out.append(_signed(key, {**push, field: value}, (np.ones(12, np.float32),)))
    payload = np.ones(12, np.float32).tobytes()
    for desc in ([["object", [12]]], [["complex64", [6]]], [["float32", [-12]]], [["float32", [13]]],
                 [["float32", [12, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                               1, 1, 1, 1, 1, 1]]], [["float32"]], "float32", [["float32", [6]], ["float32", [6]]],
                 [["float32", [True] * 12]], [[7, [12]]]):
        header = msgpack.packb({**push, "f": desc})
        out.append(_resign(key, [header, payload, b""]))
    # signed and well-formed, but not from this connection's worker, or not for this server
    out.append(_signed(key, {**push, "d": "s7"}, (np.ones(12, np.float32),)))
    out.append(_signed(key, {**push, "s": "w9"}, (np.ones(12, np.float32),)))
    out.append(_signed(key, {**push, "c": int(Cmd.INIT)}, (np.ones(12, np.float32),)))
    out.append(_signed(key, {"c": int(Cmd.STOP), "s": "H", "d": server}))
    out.append(_signed(key, {"c": int(Cmd.SET_OPTIMIZER), "s": me, "d": server, "i": 5, "a": 0,
                             "spec": {"type": "sgd"}}))
    # signed with another secret
    out.append(_signed(b"not the job secret", push, (np.ones(12, np.float32),)))
    # shared-memory references: malformed, with a payload frame as well, or from a connection not the worker's
    fake = f"hora-ps-{'0' * 12}-1-1-{rng.randbytes(8).hex()}"
    for ref in (5, "seg", {"name": fake}, True, [fake, 0, 12, "float32"], [1, 0, 12, "float32"],
                [fake, -1, 12, "float32"], [fake, 0, 12, "object"], [fake, 0, 12], [fake, True, 12, "float32"],
                ["../../etc/passwd", 0, 12, "float32"], [fake, 0, 2**63, "float32"]):
        out.append(_signed(key, {**push, "m": ref}))
    out.append(_signed(key, {**push, "m": [fake, 0, 12, "float32"]}, (np.ones(12, np.float32),)))
    out.append(_signed(key, {**push, "c": int(Cmd.PULL), "after": 0, "len": 12, "m": "yes"}))
    out.append(_signed(key, {"c": int(Cmd.RELEASE), "s": me, "d": server, "r": [1, 2, 3]}))
    out.append(_signed(key, {"c": int(Cmd.RELEASE), "s": me, "d": server, "r": "all"}))
    out.append(_signed(key, {"c": int(Cmd.SHM_HELLO), "s": me, "d": server, "i": 9, "a": 0, "who": "x",
                             "probe": fake, "nonce": "00" * 16}))
    return out


def _shm_refusals(client) -> int:
    """Shared-memory pushes on the worker's own connection that name bad ranges: each is refused."""
    assert client.shm_ok == [True], client.shm_ok  # this one-host job shares memory
    seg = shm.Segment.create(client.shm_token, 48)  # room for the 12 float32 of key f32
    seg.array(np.dtype(np.float32), 12)[:] = 1000.0  # would show in the values if any push were applied
    other = shm.Segment.create("0123456789ab", 48)  # a segment of another job
    loose = shm.Segment.create(client.shm_token, 48)
    os.chmod(f"{shm.SHM_DIR}/{loose.name}", 0o644)
    part = {"k": "f32", "seq": 1, "off": 0, "n": 12, "z": -1}
    missing = seg.name[:-4] + ("0000" if not seg.name.endswith("0000") else "1111")
    refs = {
        "a shared-memory push naming a missing segment": [missing, 0, 12, "float32"],
        "a shared-memory push naming another job's segment": [other.name, 0, 12, "float32"],
        "a shared-memory push naming a file outside the job's segments": ["../../etc/passwd", 0, 12, "float32"],
        "a shared-memory push naming a segment others can read": [loose.name, 0, 12, "float32"],
        "a shared-memory push past the end of its segment": [seg.name, 8, 12, "float32"],
        "a shared-memory push at a misaligned offset": [seg.name, 2, 11, "float32"],
        "a shared-memory push of the wrong dtype": [seg.name, 0, 6, "float64"],
        "a malformed shared-memory reference": [seg.name, 0, 12],
    }
    refused = 0
    for what, ref in refs.items():
        refused += _refused(what, lambda ref=ref: client.call(0, Cmd.PUSH, {**part, "m": ref}))
    for s in (seg, other, loose):
        s.unlink()
        s.close()
    return refused


def _refused(what: str, fn) -> int:
    try:
        fn()
    except PSError as e:
        print(f"REFUSED {what}: {e}", flush=True)
        return 1
    raise AssertionError(f"the server accepted {what}")


def fuzz(rounds: str) -> None:
    kv = kvs.create("dist_sync")
    assert kv.num_workers == 1 and kv.num_servers == 1
    client = kv._client
    kv.init(list(VALUES), list(VALUES.values()))
    rng = random.Random(1234)
    ctx = zmq.Context()
    creds = secure.credentials(client.key, client.config.encrypt)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure.secure_connect(raw, creds, client.server_addrs[0])
    sched = ctx.socket(zmq.DEALER)
    sched.setsockopt(zmq.LINGER, 0)
    secure.secure_connect(sched, creds, client.link.endpoint)
    sent = 0
    for _ in range(int(rounds)):
        for frames in bad_messages(client.key, client.id, "s0", rng):
            raw.send_multipart(frames)
            sent += 1
        for frames in bad_messages(client.key, client.id, "H", rng)[:10]:
            sched.send_multipart(frames)
    print("SENT", sent, flush=True)

    # well-formed requests on the real connection that the server must refuse, changing nothing
    refused = 0
    part = {"k": "f32", "seq": 1, "off": 0, "n": 12, "z": -1}
    refused += _refused("a float64 push to a float32 key", lambda: client.call(
        0, Cmd.PUSH, part, (np.ones(12, np.float64),)))
    refused += _refused("a push past the end of the key", lambda: client.call(
        0, Cmd.PUSH, {**part, "off": 2}, (np.ones(11, np.float32),)))
    refused += _refused("a push to an unknown key", lambda: client.call(
        0, Cmd.PUSH, {**part, "k": "nope"}, (np.ones(12, np.float32),)))
    refused += _refused("a pull of an unknown key", lambda: client.call(
        0, Cmd.PULL, {"k": "nope", "after": 0, "off": 0, "len": 1, "n": 1}))
    refused += _refused("a compressed push without compression", lambda: client.call(
        0, Cmd.PUSH, {**part, "z": 12}, (np.ones(1, np.uint32),)))
    refused += _refused("an unknown optimizer", lambda: client.call(0, Cmd.SET_OPTIMIZER, {"spec": {"type": "x"}}))
    refused += _refused("an optimizer with a bad field", lambda: client.call(
        0, Cmd.SET_OPTIMIZER, {"spec": {"type": "sgd", "momentum": "lots"}}))
    refused += _refused("an unknown compression", lambda: client.call(
        0, Cmd.SET_COMPRESSION, {"spec": {"type": "1bit"}}))
    refused += _refused("states without an optimizer", lambda: client.call(0, Cmd.GET_STATES, {}))
    refused += _shm_refusals(client)

    # every value is what init stored, and the server still works
    checked = 0
    for key, value in VALUES.items():
        out = np.empty_like(value)
        kv.pull(key, out=out)
        np.testing.assert_array_equal(out, value, err_msg=f"key {key} changed")
        checked += 1
    kv.push("f32", np.full(12, 4.0, np.float32))
    out = np.empty(12, np.float32)
    kv.pull("f32", out=out)
    np.testing.assert_array_equal(out, np.full(12, 4.0, np.float32))
    kv.barrier()  # the scheduler survived its share too
    client.call(SCHEDULER, Cmd.BARRIER, {"seq": 999})
    raw.close()
    sched.close()
    ctx.term()
    kv.close()
    print("REFUSED_TOTAL", refused, flush=True)
    print("CHECKED", checked + 1, flush=True)
