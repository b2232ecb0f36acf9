"""loadtest/exchange_profile.py: a callgrind dump's instructions summed by component, each counted once."""

from __future__ import annotations

from loadtest import exchange_profile

# A dump as callgrind writes it (names compressed to ids after their first use, positions relative): OpenSSL
# calls into lxml, whose 1,000 instructions appear twice, as the call's inclusive cost and as lxml's own.
DUMP = """\
version: 1
creator: callgrind-3.19.0
events: Ir
ob=(1) /usr/lib/x86_64-linux-gnu/libcrypto.so.3
fl=(1) ???
fn=(1) 0x000000000029ad80
0 500
cob=(2) /venv/lib/python3.11/site-packages/lxml/etree.cpython-311-x86_64-linux-gnu.so
cfi=(2) ???
cfn=(2) 0x000000000008ba80
calls=1 0
0 1000
ob=(2)
fl=(2)
fn=(2)
0 1000
ob=(3) /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
fl=(3) Python/ceval.c
fn=(3) _PyEval_EvalFrameDefault
+2 300
* 20
ob=(4) /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
fn=(4) _dl_lookup
0 7
summary: 1827
totals: 1827
"""


def test_a_callees_instructions_count_once_in_its_own_component() -> None:
    counts = exchange_profile.self_counts(DUMP.splitlines(keepends=True))
    assert counts == {"OpenSSL": 500, "lxml + libxml2": 1000, "Python": 320, "other": 7}
    assert sum(counts.values()) == 1827  # the dump's own total
