"""Keys and certificates shared by the SNS and SES tests of this folder.

One RSA key and its self-signed certificate (helpers.keys) for the whole
session: generating a 2048-bit key is the slow part, and no test changes them.
"""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers.keys import make_certificate, rsa_key


@pytest.fixture(scope="session")
def signing_key() -> rsa.RSAPrivateKey:
    return rsa_key()


@pytest.fixture(scope="session")
def certificate(signing_key: rsa.RSAPrivateKey) -> bytes:
    return make_certificate(signing_key)
