"""Policy validation: errors name the file, the route and the field; `wsgate check` reports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.policy import PolicyError, load_dir

REPO = Path(__file__).resolve().parents[2]


def write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp


GOOD = """
routes:
  - name: orders
    match: {path_prefix: /orders/}
    upstream: {address: "127.0.0.1:9000"}
    profile: xml
"""


def test_repo_policies_are_valid() -> None:
    ps = load_dir(REPO / "policies")
    assert {r.profile for r in ps.routes} >= {"none", "xml", "tls"}


def test_good_policy_loads_with_defaults(tmp_path: Path) -> None:
    ps = load_dir(write(tmp_path, "a.yaml", GOOD))
    route = ps.route("orders")
    assert route.limits.max_body_bytes == 10 * 1024 * 1024
    assert route.timestamp.required is True
    assert ps.sources["orders"].endswith("a.yaml")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (GOOD.replace("profile: xml", "profile: kerberos"), "field profile"),
        (GOOD.replace('"127.0.0.1:9000"', '"no-port"'), "field upstream.address"),
        (GOOD.replace("/orders/", "orders"), "field match.path_prefix"),
        (GOOD + "    limits: {max_depth: 1000}\n", "field limits.max_depth"),
        (GOOD + "    colour: blue\n", "field colour"),
        (GOOD + "    signature: {parts: [timestamp]}\n", "field signature.parts"),
        (GOOD + "    username_token: {required: true}\n", "field username_token"),
    ],
)
def test_errors_name_file_route_and_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        load_dir(write(tmp_path, "orders.yaml", text))
    msg = str(err.value)
    assert f"{tmp_path / 'orders.yaml'}: route orders: {field}" in msg


def test_secured_routes_default_to_knowing_who_calls_and_forwarding_only_what_is_signed(tmp_path: Path) -> None:
    route = load_dir(write(tmp_path, "a.yaml", GOOD.replace("profile: xml", "profile: hmac"))).route("orders")
    assert route.hmac.allow_anonymous is False
    assert (route.unsigned_headers.default, route.unsigned_headers.addressing) == ("strip", "strip")


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ("    hmac: {allow_encrypted_key: true}\n", "hmac", "replaced by allow_anonymous"),
        ("    unsigned_headers: {addressing: keep}\n", "unsigned_headers.addressing", "forward"),
    ],
)
def test_header_and_anonymity_fields_are_validated(tmp_path: Path, extra: str, field: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_dir(write(tmp_path, "a.yaml", GOOD.replace("profile: xml", "profile: hmac") + extra))
    assert f"route orders: field {field}" in str(info.value) and message in str(info.value)


def test_duplicate_route_names_across_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", GOOD)
    write(tmp_path, "b.yaml", GOOD.replace("/orders/", "/other/"))
    with pytest.raises(PolicyError, match=r"b.yaml: route orders: field name: already defined in .*a.yaml"):
        load_dir(tmp_path)


def test_unset_environment_variable_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="WSGATE_TEST_UNSET_VAR is not set"):
        load_dir(write(tmp_path, "a.yaml", GOOD.replace('"127.0.0.1:9000"', '"${WSGATE_TEST_UNSET_VAR}"')))


def test_environment_default_is_used(tmp_path: Path) -> None:
    ps = load_dir(
        write(tmp_path, "a.yaml", GOOD.replace('"127.0.0.1:9000"', '"${WSGATE_TEST_UNSET_VAR:-10.1.2.3:81}"'))
    )
    assert ps.route("orders").upstream.address == "10.1.2.3:81"


def test_wsgate_check_cli(tmp_path: Path) -> None:
    bad = write(tmp_path, "orders.yaml", GOOD.replace("profile: xml", "profile: kerberos"))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.control.cli", "check", str(bad)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "route orders: field profile" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "gateway.control.cli", "check", str(REPO / "policies")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "ok  xml" in run.stdout


EDGE = """
edge:
  request_timeout_s: 20
"""


def test_edge_defaults_hold_without_a_section(tmp_path: Path) -> None:
    edge = load_dir(write(tmp_path, "a.yaml", GOOD)).edge
    assert (edge.request_headers_timeout_s, edge.request_timeout_s, edge.xff_num_trusted_hops) == (10, 60, 0)


def test_only_one_file_may_set_edge(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", GOOD + EDGE)
    write(tmp_path, "b.yaml", GOOD.replace("orders", "billing") + EDGE)
    with pytest.raises(PolicyError, match=r"b\.yaml: field edge: already set in .*a\.yaml"):
        load_dir(tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("edge: {request_timeout_s: 0}", r"a\.yaml: field edge\.request_timeout_s: Input should be greater than 0"),
        ("edge: {xff_hops: 1}", r"a\.yaml: field edge\.xff_hops: Extra inputs are not permitted"),
        ("edge: {stream_idle_timeout_s: 30}",
         r"a\.yaml: route orders: field upstream\.timeout_s: 30 s is not below edge\.stream_idle_timeout_s"),
    ],
)  # fmt: skip
def test_edge_errors_name_the_file_and_field(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        load_dir(write(tmp_path, "a.yaml", GOOD + extra + "\n"))


@pytest.mark.parametrize("name", ["x_wsgate_subject", "X-Caller", "x-caller "])
def test_identity_headers_are_lowercase_without_underscores(tmp_path: Path, name: str) -> None:
    """Envoy drops client headers with underscores and lowercases names: any other spelling could never be stripped
    reliably nor set."""
    with pytest.raises(PolicyError, match="field identity_header"):
        load_dir(write(tmp_path, "a.yaml", GOOD + f"    identity_header: '{name}'\n"))


def test_prefixes_that_differ_only_in_case_are_the_same_match(tmp_path: Path) -> None:
    """Envoy matches prefixes ignoring case (a backend like IIS does too): /Orders/ and /orders/ would collide."""
    other = GOOD.replace("name: orders", "name: billing").replace("/orders/", "/Orders/")
    with pytest.raises(PolicyError, match="route billing: field match: same match as route orders"):
        load_dir(write(write(tmp_path, "a.yaml", GOOD), "b.yaml", other))
