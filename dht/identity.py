"""Who a peer is: an RSA key (hivemind's), whose fingerprint is the peer's id everywhere in the swarm.

A server's DHT record is stored under a subkey that carries its public key (hivemind's `[owner:...]` convention), so
hivemind's `RSASignatureValidator` makes every DHT node refuse a change to it not signed with that key: nobody can
write, overwrite or hide another peer's record. The peer id readers use is derived from that key, never taken from
what a record or message says about itself, so a forger cannot claim another peer's id either. `Progress` messages
between stage peers are signed with the same key (server/collab/progress.py).
"""

from __future__ import annotations

import hashlib
import re

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

MAX_PUBLIC_KEY_BYTES = 1024  # a serialized 2048-bit RSA public key is ~400 bytes
_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)  # hivemind's own pattern for "[owner:<key>]"


def fingerprint(public_key: bytes) -> str:
    """A peer's id: short, printable, and bound to its key."""
    return "k" + hashlib.sha256(public_key).hexdigest()[:32]


class Identity:
    def __init__(self, private_key: RSAPrivateKey | None = None):
        self.private_key = private_key or RSAPrivateKey()
        self.public_key = self.private_key.get_public_key().to_bytes()
        self.peer_id = fingerprint(self.public_key)
        self.validator = RSASignatureValidator(self.private_key)

    @property
    def owner_subkey(self) -> bytes:
        """The DHT subkey of this peer's records: only this key can sign changes to it."""
        return self.validator.local_public_key

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def owner_of(subkey: object) -> bytes | None:
    """The public key a DHT subkey names as its owner, or None if it names none (an unprotected record)."""
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.fullmatch(subkey)
    return found.group(1) if found else None


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """False for a malformed key or signature, as for a wrong one."""
    if not 0 < len(public_key) <= MAX_PUBLIC_KEY_BYTES or not 0 < len(signature) <= 2048:
        return False
    try:
        return RSAPublicKey.from_bytes(public_key).verify(data, signature)
    except Exception:  # whatever `cryptography` raises on garbage
        return False
