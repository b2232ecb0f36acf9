"""Start-up check: lxml and xmlsec must use the same libxml2, or trees passed between them corrupt memory."""

from __future__ import annotations

import xmlsec
from lxml import etree


def check_libxml2() -> None:
    lxml_version = etree.LIBXML_VERSION
    xmlsec_version = xmlsec.get_libxml_version()
    if tuple(lxml_version) != tuple(xmlsec_version):
        raise SystemExit(
            f"lxml uses libxml2 {lxml_version} but xmlsec uses {xmlsec_version}: "
            "install matching wheels (see pyproject.toml pins)"
        )
