"""The STR-Transform (WSS 1.1, 8.3): a sender-vouches signature covering the assertion through its STR.

Messages are made by our sending side with the STR signed plainly, then that reference is turned into an
STR-Transform one (digest of the assertion's transformed form, SignedInfo re-signed by the attesting party), so
each threat differs from the honest control by one edit. Metro's own messages: tests/interop/test_metro_saml_interop.py."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from lxml import etree

from filters.engine import ns
from filters.engine.profiles import SamlPipeline
from filters.engine.wss import keys, str_transform
from filters.engine.xml import c14n
from gateway.policy import Route
from tests.support import saml as S
from tests.threats.test_saml_assertions import accepted, beside, refused


def _ds(local: str) -> str:
    return ns.q(ns.DS, local)


INCLUSIVE_C14N = "http://www.w3.org/TR/2001/REC-xml-c14n-20010315"
ASSERTION = ns.q(ns.SAML2, "Assertion")


Edit = Callable[[etree._Element, etree._Element, etree._Element, etree._Element], None]


def str_transformed(route: Route, pki: Path, edit: Edit | None = None, signer: str = "client2") -> bytes:
    """A sender-vouches message whose signature covers the assertion through an STR-Transform reference;
    `edit(root, reference, transform, str)` changes it before the digest and the signature are computed."""
    root = etree.fromstring(beside(route, pki, S.sign(S.assertion_xml(pki), pki), signer, sign_reference=True))
    security = next(root.iter(ns.q(ns.WSSE, "Security")))
    str_el = security.find(str_transform.STR)  # the header's own STR, not the one in the signature's KeyInfo
    info = security.find(f"{_ds('Signature')}/{_ds('SignedInfo')}")  # the message's, not the assertion's
    ref = next(r for r in info.iter(_ds("Reference")) if r.get("URI") == "#" + str_el.get(ns.q(ns.WSU, "Id")))
    transform = ref.find(f"{_ds('Transforms')}/{_ds('Transform')}")
    transform[:] = []
    transform.set("Algorithm", str_transform.ALGORITHM)
    params = etree.SubElement(transform, str_transform.PARAMETERS, nsmap={"wsse": ns.WSSE})
    etree.SubElement(params, _ds("CanonicalizationMethod"), Algorithm=str_transform.EXC_C14N)
    if edit is not None:
        edit(root, ref, transform, str_el)
    assertion = next(root.iter(ASSERTION))
    digest = hashlib.sha256(str_transform.output(assertion, [])).digest()
    ref.find(_ds("DigestValue")).text = base64.b64encode(digest).decode()
    inclusive = info.find(f"{_ds('CanonicalizationMethod')}/{str_transform.INCLUSIVE_NAMESPACES}")
    prefixes = (inclusive.get("PrefixList") or "").split() if inclusive is not None else []
    key = keys.load_private_key(str(pki / f"{signer}.key"))
    value = key.sign(c14n.canonical(info, prefixes), padding.PKCS1v15(), hashes.SHA256())
    info.getnext().text = base64.b64encode(value).decode()
    return etree.tostring(root)


def test_str_transform_sender_vouches_gets_through(route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    """The control: the attesting party signs the assertion through its STR, as Metro and WSS4J do."""
    assert accepted(pipeline, str_transformed(route, pki))["x-wsgate-subject"] == S.SUBJECT


def _name_another_token(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    """The STR points at the attesting party's BinarySecurityToken: the transform would digest that instead."""
    bst = next(root.iter(ns.q(ns.WSSE, "BinarySecurityToken")))
    str_el[:] = []
    etree.SubElement(str_el, ns.q(ns.WSSE, "Reference"), URI="#" + bst.get(ns.q(ns.WSU, "Id")))


def _inclusive_c14n(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    t[0][0].set("Algorithm", INCLUSIVE_C14N)


def _extra_transform(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    t.addnext(etree.Element(_ds("Transform"), Algorithm=str_transform.EXC_C14N))


def _no_parameters(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    t[:] = []


def _two_methods(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    t[0].append(etree.Element(_ds("CanonicalizationMethod"), Algorithm=str_transform.EXC_C14N))


def _onto_the_timestamp(root: etree._Element, ref: etree._Element, t: etree._Element, str_el: etree._Element) -> None:
    """The transform on a reference to an element that is no STR (the Timestamp, also signed)."""
    stamp = next(root.iter(ns.q(ns.WSU, "Timestamp")))
    for other in ref.getparent().iter(_ds("Reference")):
        if other.get("URI") == "#" + stamp.get(ns.q(ns.WSU, "Id")):
            other.getparent().remove(other)
    ref.set("URI", "#" + stamp.get(ns.q(ns.WSU, "Id")))


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (_inclusive_c14n, "UnsupportedAlgorithm"),
        (_extra_transform, "InvalidSecurity"),
        (_no_parameters, "InvalidSecurity"),
        (_two_methods, "InvalidSecurity"),
        (_onto_the_timestamp, "InvalidSecurity"),
    ],
    ids=["inclusive_c14n", "extra_transform", "without_parameters", "two_methods",
         "onto_an_element_not_an_str"],
)  # fmt: skip
def test_str_transform_variant_refused(edit: Edit, code: str, route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    refused(pipeline, str_transformed(route, pki, edit), code)


def test_str_transform_naming_another_token_refused(pipeline: SamlPipeline, route: Route, pki: Path) -> None:
    """An STR-Transform reference whose STR names the attesting party's BinarySecurityToken: the transform resolves
    an STR only to the header's verified assertion (and the header takes no STR naming anything else)."""
    refused(pipeline, str_transformed(route, pki, _name_another_token), "InvalidSecurity")


def test_str_transform_digest_of_another_assertion_refused(route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    """The assertion swapped after signing for another one of the same ID from the same IdP (another subject):
    the transform digests the assertion actually verified, by identity, so the digest no longer matches."""
    root = etree.fromstring(str_transformed(route, pki))
    held = next(root.iter(ASSERTION))
    other = S.sign(S.assertion_xml(pki, subject="admin@example.org", assertion_id=held.get("ID")), pki)
    held.getparent().replace(held, other)
    refused(pipeline, etree.tostring(root), "FailedCheck")


def test_str_transform_by_a_party_not_allowed_to_vouch_refused(route: Route, pipeline: SamlPipeline,
                                                               pki: Path) -> None:  # fmt: skip
    refused(pipeline, str_transformed(route, pki, signer="client"), "FailedAuthentication")
