"""The pure pieces of state transfer: the digest, the schema, the header and the chunks."""

import pytest
import torch

from swarmloco.core.state import (
    LANDED,
    MAX_LANDED_VALUES,
    MOMENTUM,
    THETA_G,
    StateHasher,
    StateSchema,
    StateSnapshot,
    TensorSpec,
    raw_bytes,
    state_digest,
)
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.net.state import wire
from swarmloco.net.state.files import FileSink, write_state

SWARM = "5a" * 20
LIMITS = wire.ReceiveLimits(min_chunk_bytes=16)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {THETA_G: torch.randn(1001, generator=g), MOMENTUM: torch.randn(1001, generator=g)}


def test_the_digest_ignores_dict_order_and_sees_every_bit_name_and_dtype():
    state = tensors()
    digest = state_digest(state)
    assert state_digest(dict(reversed(state.items()))) == digest
    flipped = {k: v.clone() for k, v in state.items()}
    raw_bytes(flipped[MOMENTUM])[4000] ^= 1
    assert state_digest(flipped) != digest
    assert state_digest({"theta": state[THETA_G], MOMENTUM: state[MOMENTUM]}) != digest
    as_int = {THETA_G: state[THETA_G].view(torch.int32), MOMENTUM: state[MOMENTUM]}
    assert state_digest(as_int) != digest
    # Moving bytes from one tensor to the other changes the digest too.
    moved = {
        THETA_G: state[THETA_G][:-1],
        MOMENTUM: torch.cat([state[THETA_G][-1:], state[MOMENTUM]]),
    }
    assert state_digest(moved) != digest


def test_the_hasher_gives_the_same_digest_over_any_cuts():
    state = dict(sorted(tensors().items()))
    data = b"".join(bytes(raw_bytes(t)) for t in state.values())
    specs = [TensorSpec(name, "float32", t.numel()) for name, t in state.items()]
    for cut in (1, 7, 4096, len(data)):
        hasher = StateHasher(specs)
        for start in range(0, len(data), cut):
            hasher.update(data[start : start + cut])
        assert hasher.digest() == state_digest(state)


def test_snapshots_check_their_tensors():
    with pytest.raises(ValueError, match="flat"):
        StateSnapshot.of(swarm_id=SWARM, round=0, tensors={THETA_G: torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="dtype"):
        StateSnapshot.of(
            swarm_id=SWARM, round=0, tensors={THETA_G: torch.zeros(2).to(torch.cfloat)}
        )
    with pytest.raises(ValueError, match="tensor name"):
        StateSnapshot.of(swarm_id=SWARM, round=0, tensors={"a b": torch.zeros(2)})
    with pytest.raises(ValueError, match="round"):
        StateSnapshot.of(swarm_id=SWARM, round=-1, tensors={})
    snapshot = StateSnapshot.of(swarm_id=SWARM.upper(), round=3, tensors=tensors())
    assert list(snapshot.tensors) == [MOMENTUM, THETA_G] and snapshot.swarm_id == SWARM


def test_the_diloco_schema():
    schema = StateSchema.diloco(1001)
    full = [TensorSpec(MOMENTUM, "float32", 1001), TensorSpec(THETA_G, "float32", 1001)]
    assert schema.mismatch(full) is None
    assert schema.mismatch(full[1:]) is None  # a fresh swarm has no momentum
    assert "lacks theta_g" in (schema.mismatch(full[:1]) or "")
    assert "float16[1001]" in (schema.mismatch([TensorSpec(THETA_G, "float16", 1001)]) or "")
    assert "'extra'" in (schema.mismatch([*full, TensorSpec("extra", "uint8", 1)]) or "")
    # What landed of a pinned dataset: int64 of any length from 1 up to its bound.
    for n in (1, 9, MAX_LANDED_VALUES):
        assert schema.mismatch([*full, TensorSpec(LANDED, "int64", n)]) is None
    too_long = schema.mismatch([*full, TensorSpec(LANDED, "int64", MAX_LANDED_VALUES + 1)])
    assert f"at most {MAX_LANDED_VALUES}" in (too_long or "")
    assert "float32[9]" in (schema.mismatch([*full, TensorSpec(LANDED, "float32", 9)]) or "")
    assert "at most" in (schema.mismatch([*full, TensorSpec(LANDED, "int64", 0)]) or "")


def signed(identity: Identity, snapshot: StateSnapshot, nonce: bytes = bytes(16), chunk: int = 100):
    return wire.sign_header(identity, snapshot, nonce=nonce, chunk_bytes=chunk, timestamp_ms=1)


def test_a_header_is_bound_to_its_donor_its_request_and_its_contents():
    identity = Identity.generate()
    snapshot = StateSnapshot.of(swarm_id=SWARM, round=3, tensors=tensors())
    header = signed(identity, snapshot)
    check = dict(peer_id=identity.peer_id_hex, nonce=bytes(16), swarm_id=SWARM, limits=LIMITS)
    checked = wire.check_header(header, **check)
    assert checked.total_bytes == 8008 and checked.chunks == 81 and checked.round == 3

    def code(**changes) -> str:
        with pytest.raises(Rejection) as caught:
            wire.check_header(header, **{**check, **changes})
        return caught.value.code

    assert code(nonce=bytes(15) + b"\x01") == "replayed"
    assert code(peer_id=Identity.generate().peer_id_hex) == "wrong-donor"
    assert code(swarm_id="a5" * 20) == "wrong-swarm"
    assert code(round=4) == "wrong-round"
    assert code(digest=bytes(32)) == "wrong-digest"
    assert code(schema=StateSchema.diloco(1000)) == "bad-layout"
    small = wire.ReceiveLimits(max_state_bytes=8000, min_chunk_bytes=16)
    assert code(limits=small) == "too-large"
    # A state of the schema's layout is as large as the requester's own: no cap on it (a
    # data-parallel run past 2B parameters hands its state on), and a layout claim that
    # does not fit the schema is refused before its size counts.
    fits = wire.check_header(header, **{**check, "limits": small}, schema=StateSchema.diloco(1001))
    assert fits.total_bytes == 8008
    assert code(limits=small, schema=StateSchema.diloco(1000)) == "bad-layout"
    assert code(limits=wire.ReceiveLimits(min_chunk_bytes=4096)) == "bad-layout"
    header.round = 4  # any change to a signed field breaks the signature
    assert code() == "bad-signature"


@pytest.mark.parametrize("into", ["memory", "file"])
@pytest.mark.parametrize("chunk", [16, 100, 4004, 4005, 8008, 100_000])
def test_chunks_reassemble_into_the_same_tensors(chunk, into, tmp_path):
    identity = Identity.generate()
    snapshot = StateSnapshot.of(swarm_id=SWARM, round=3, tensors=tensors())
    checked = wire.check_header(
        signed(identity, snapshot, chunk=chunk),
        peer_id=identity.peer_id_hex,
        nonce=bytes(16),
        swarm_id=SWARM,
        limits=LIMITS,
    )
    chunks = list(snapshot.chunks(chunk))
    assert len(chunks) == checked.chunks and all(len(c) == chunk for c in chunks[:-1])
    sink = FileSink(tmp_path, checked.specs) if into == "file" else None
    assembler = wire.StateAssembler(checked, sink)
    for index, data in enumerate(chunks):
        assert not assembler.complete
        assembler.accept(index, data)
    got = assembler.finish()
    assert got.digest == snapshot.digest and got.round == 3
    assert all(torch.equal(got.tensors[name], t) for name, t in snapshot.tensors.items())
    assert list(tmp_path.iterdir()) == []  # the file has no name: nothing to clean up
    with pytest.raises(Rejection, match="after the last chunk"):
        assembler.accept(len(chunks), b"")


def test_the_assembler_refuses_wrong_chunks_and_a_wrong_digest():
    identity = Identity.generate()
    snapshot = StateSnapshot.of(swarm_id=SWARM, round=3, tensors=tensors())
    header = signed(identity, snapshot, chunk=1000)
    checked = wire.check_header(
        header, peer_id=identity.peer_id_hex, nonce=bytes(16), swarm_id=SWARM, limits=LIMITS
    )
    chunks = [bytes(c) for c in snapshot.chunks(1000)]
    assembler = wire.StateAssembler(checked)
    with pytest.raises(Rejection, match="chunk 1 arrived where chunk 0"):
        assembler.accept(1, chunks[1])
    with pytest.raises(Rejection, match="999 bytes, 1000 were due"):
        assembler.accept(0, chunks[0][:-1])
    with pytest.raises(Rejection, match="after 0 of 9 chunks"):
        assembler.finish()
    chunks[8] = bytes(len(chunks[8]))
    for index, data in enumerate(chunks):
        assembler.accept(index, data)
    with pytest.raises(Rejection) as caught:
        assembler.finish()
    assert caught.value.code == "bad-digest"


def test_requests_are_checked():
    good = wire.encode_request(swarm_id=SWARM, nonce=bytes(16), round=0)
    request = wire.decode_request(good)
    assert request.HasField("round") and request.round == 0
    assert not wire.decode_request(wire.encode_request(swarm_id=SWARM, nonce=bytes(16))).HasField(
        "round"
    )
    for bad in (b"\xff", wire.encode_request(swarm_id=SWARM, nonce=bytes(8)), bytes(2000)):
        with pytest.raises(Rejection, match="request"):
            wire.decode_request(bad)


def test_a_state_in_a_file_reads_back_in_every_way_and_hashes_as_in_memory(tmp_path):
    state = tensors(1) | {"tokens": torch.tensor([7], dtype=torch.int64)}
    in_memory = StateSnapshot.of(swarm_id=SWARM, round=5, tensors=state)
    on_disk = write_state(tmp_path, swarm_id=SWARM, round=5, tensors=state)
    assert on_disk.digest == in_memory.digest == state_digest(state)
    assert on_disk.specs == in_memory.specs and on_disk.nbytes == in_memory.nbytes
    for cut in (16, 1000, 100_000):
        assert b"".join(on_disk.chunks(cut)) == b"".join(bytes(c) for c in in_memory.chunks(cut))
    out = torch.empty(1001)
    on_disk.read_into(MOMENTUM, out)
    assert torch.equal(out, state[MOMENTUM])
    pieces = [p.clone() for p in on_disk.pieces(THETA_G, values=300)]
    assert [p.numel() for p in pieces] == [300, 300, 300, 101]
    assert torch.equal(torch.cat(pieces), state[THETA_G])
    assert int(on_disk.tensor("tokens")[0]) == 7
    with pytest.raises(ValueError, match="float32"):
        on_disk.read_into(THETA_G, torch.empty(1001, dtype=torch.float64))
    assert list(tmp_path.iterdir()) == []  # unnamed: gone with its last reader, or a crash


def test_a_state_file_given_its_digest_trusts_it(tmp_path):
    state = tensors(2)
    digest = state_digest(state)
    snapshot = write_state(tmp_path, swarm_id=SWARM, round=1, tensors=state, digest=digest)
    assert snapshot.digest == digest
    assert state_digest(dict(snapshot.tensors)) == digest
