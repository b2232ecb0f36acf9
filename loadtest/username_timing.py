"""Does a UsernameToken check take the same time whoever it names? `python -m loadtest.username_timing [N]`

Times the gateway's own check (filters.engine.wss.username_token.verify, no throttle, no cache) N times per case on a fresh
demo PKI and prints the median, min and max: hashed, stored-password and unknown users must not be told apart."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from lxml import etree

from certs import pki
from filters.engine import faults
from filters.engine.wss.username_token import Users, create, verify
from gateway.policy import UsernameTokenPolicy

CASES = {
    "text, hashed user (alice), wrong": ("alice", "wrong", False),
    "text, stored password (bob), wrong": ("bob", "wrong", False),
    "text, stored password (bob), right": ("bob", pki.DEMO_USERS["bob"], False),
    "text, unknown user, wrong": ("mallory", "wrong", False),
    "digest, stored password (bob), wrong": ("bob", "wrong", True),
    "digest, hashed user (alice)": ("alice", "x", True),
    "digest, unknown user": ("mallory", "x", True),
}


def main(n: int) -> None:
    users = Users.load(pki.init(Path(tempfile.mkdtemp())) / "users.yaml", cache_size=0)
    policy = UsernameTokenPolicy(password_types=["digest", "text"])
    for name, (user, password, digest) in CASES.items():
        times = []
        for _ in range(n):
            now = datetime.now(UTC)
            token = etree.fromstring(etree.tostring(create(user, password, digest, now, "u")))
            start = time.perf_counter()
            try:
                verify(token, users, policy, now, 300, 300)
            except faults.Fault:
                pass
            times.append((time.perf_counter() - start) * 1000)
        print(f"{name:40s} median {statistics.median(times):7.2f} ms  min {min(times):7.2f}  max {max(times):7.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
