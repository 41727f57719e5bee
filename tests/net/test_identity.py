import os
import stat

import pytest

from swarmloco.net.identity import KEY_FILE_NAME, Identity, IdentityError, peer_id_of, verify


def test_key_is_created_private_and_reused(tmp_path):
    first = Identity.load_or_create(tmp_path / "peer")
    path = tmp_path / "peer" / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create(tmp_path / "peer")
    assert again.peer_id == first.peer_id
    assert again.public_key == first.public_key
    assert first.peer_id == peer_id_of(first.public_key)
    assert len(first.peer_id) == 20


def test_key_readable_by_others_is_refused(tmp_path):
    Identity.load_or_create(tmp_path)
    os.chmod(tmp_path / KEY_FILE_NAME, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def test_garbage_key_file_is_refused(tmp_path):
    path = tmp_path / KEY_FILE_NAME
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not an unencrypted Ed25519 private key"):
        Identity.load_or_create(tmp_path)


def test_signatures_bind_key_domain_and_payload():
    alice, mallory = Identity.generate(), Identity.generate()
    signature = alice.sign(b"domain-a", b"payload")
    assert verify(alice.public_key, signature, b"domain-a", b"payload")
    assert not verify(alice.public_key, signature, b"domain-b", b"payload")
    assert not verify(alice.public_key, signature, b"domain-a", b"payloaD")
    assert not verify(mallory.public_key, signature, b"domain-a", b"payload")
    assert not verify(b"short", signature, b"domain-a", b"payload")
    assert not verify(alice.public_key, signature[:-1], b"domain-a", b"payload")
