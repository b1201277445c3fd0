"""TLS on the Stage service with certificates pinned by signed DHT records (swarm/protocol/tls.py): real servers,
real DHT, real handshakes."""

import pytest

from dht.records import ServerRecord
from swarm.protocol.tls import TlsConfig, self_signed

pytestmark = pytest.mark.timeout(30)


def test_records_with_a_malformed_or_oversized_certificate_are_refused():
    good = self_signed().cert_pem
    base = dict(host="127.0.0.1", port=5000, stage=0)
    assert ServerRecord.from_dict({**base, "tls_cert": good}) is not None
    assert ServerRecord.from_dict({**base, "tls_cert": ""}) is not None
    for bad in ("garbage", good[:200], good + "x" * 3000, 5, None):
        assert ServerRecord.from_dict({**base, "tls_cert": bad}) is None, bad


def test_tls_flags_are_checked():
    with pytest.raises(ValueError, match="go together"):
        TlsConfig(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="makes its own"):
        TlsConfig(tls_cert="c", tls_key="k", tls_self_signed=True)
