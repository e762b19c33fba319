"""``horovod.runner.common.util.secret``: a random job key and HMAC-SHA256 digests, as Horovod makes them."""

import hashlib
import hmac
import os

SECRET_LENGTH = 32
DIGEST_LENGTH = 32
HOROVOD_SECRET_KEY = "_HOROVOD_SECRET_KEY"


def make_secret_key() -> bytes:
    return os.urandom(SECRET_LENGTH)


def compute_digest(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def check_digest(key: bytes, message: bytes, digest: bytes) -> bool:
    return hmac.compare_digest(compute_digest(key, message), digest)
