"""hivemind's DHT authorization, with a private swarm's key as the authority (swarm/protocol/access.py)."""

from __future__ import annotations

import hashlib
import hmac
import logging

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm.protocol.access import Refusals, SwarmKey

logger = logging.getLogger(__name__)
TOKEN_LIFETIME_S = 3600.0


class SwarmKeyAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorization with the swarm key as the authority: a node's access token is its public key and
    an expiry, MACed with the key (hivemind signs each request and reply with the node's own key and checks the
    token, the signature, the time and the nonce)."""

    def __init__(self, key: SwarmKey, private_key: RSAPrivateKey):
        super().__init__(private_key)
        self.key = key
        self.refusals = Refusals()

    def _tag(self, token: AccessToken) -> bytes:
        return self.key.mac(b"dht", token.username.encode(), token.public_key, token.expiration_time.encode())

    async def get_token(self) -> AccessToken:
        public_key = self.local_public_key.to_bytes()
        token = AccessToken(
            username=hashlib.sha256(public_key).hexdigest()[:16],
            public_key=public_key,
            expiration_time=f"{get_dht_time() + TOKEN_LIFETIME_S:.0f}",
        )
        token.signature = self._tag(token)
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            expires = float(access_token.expiration_time)
        except ValueError:
            return False
        return expires > get_dht_time() and hmac.compare_digest(access_token.signature, self._tag(access_token))

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return float(access_token.expiration_time) < get_dht_time() + TOKEN_LIFETIME_S / 4

    async def validate_request(self, request) -> bool:
        if await super().validate_request(request):
            return True
        self.refusals.add(
            logger,
            "refused a DHT request without a valid proof of swarm %s's key: a peer started without --swarm-key, or "
            "with another one",
            self.key.swarm_id,
        )
        return False
