"""loadtest/exchange_profile.py and gateway_profile.py: instructions and samples summed by component, each counted once."""

from __future__ import annotations

from loadtest import exchange_profile, gateway_profile

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
    assert counts == {"libcrypto": 500, "lxml + libxml2": 1000, "Python": 320, "other": 7}
    assert sum(counts.values()) == 1827  # the dump's own total


# `perf report --stdio --no-children -n --sort dso` of a filter worker.
PERF_REPORT = """\
# Samples: 1K of event 'cpu-clock'
#
# Overhead       Samples  Shared Object
# ........  ............  ..................................
#
    52.10%           521  libpython3.11.so.1.0
    20.00%           200  etree.cpython-311-x86_64-linux-gnu.so
     9.00%            90  [kernel.kallsyms]
     6.00%            60  wsgate_frame.cpython-311-x86_64-linux-gnu.so
     5.00%            50  xmlsec.cpython-311-x86_64-linux-gnu.so
     4.00%            40  libc.so.6
     2.00%            20  _hashlib.cpython-311-x86_64-linux-gnu.so
     1.90%            19  libcrypto.so.3
"""


def test_a_gateway_sample_is_charged_to_the_component_its_shared_object_belongs_to() -> None:
    by_dso = gateway_profile.samples_by_dso(PERF_REPORT.splitlines())
    assert sum(by_dso.values()) == 1000
    counts: dict[str, int] = {}
    for dso, n in by_dso.items():
        counts[gateway_profile.component("filter", dso)] = counts.get(gateway_profile.component("filter", dso), 0) + n
    # lxml's and xmlsec's modules are Python extensions too: named by what they are, never as the interpreter
    assert counts == {"Python": 541, "lxml + libxml2": 200, "kernel": 90, "frame": 60, "xmlsec+OpenSSL": 50,
                      "libc": 40, "libcrypto": 19}  # fmt: skip
    assert gateway_profile.component("envoy", "envoy") == "envoy"
    assert gateway_profile.component("envoy", "libc.so.6") == "envoy"  # Envoy's process is Envoy, whole
    assert gateway_profile.component("redis", "[kernel.kallsyms]") == "redis: kernel"
