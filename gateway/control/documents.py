"""The documents a route names (its WSDL, its XSDs, the next signing certificate it publishes) read and its schema compiled as the filter workers will, so
that `wsgate check`, `wsgate up` and a policy reload refuse them before anything uses them: a reference to the
network or outside the file's directory, a DTD, a schema that does not compile is a policy error. The model
(gateway/policy.py) validates fields only; the engine refuses the same documents when it builds a pipeline."""

from __future__ import annotations

from pathlib import Path

from filters.engine.wss import keys
from filters.engine.xml import schema_validation, wsdl
from gateway.policy import PolicySet, Route, load_dir


def errors(route: Route) -> list[str]:
    # The next signing certificate is published (?wsdl, `wsgate certs published`), read by no worker.
    if route.rsa.next_certificate and route.profile in ("rsa", "secureconversation"):
        try:
            keys.load_certificate(route.rsa.next_certificate)
        except (OSError, ValueError) as exc:
            return [f"field rsa.next_certificate: {type(exc).__name__}: {exc}"]
    if route.wsdl is None and not route.schema_validation.enabled:
        return []
    field = "wsdl.file" if route.wsdl else "schema_validation.xsd_files"
    try:
        if route.schema_validation.enabled:
            field = "schema_validation"
            schema_validation.for_route(route)
        elif route.wsdl:
            wsdl.load(route.wsdl.file)
    except wsdl.DocumentError as exc:
        return [f"field {field}: {exc}"]
    return []


def load_checked(directory: Path | str) -> PolicySet:
    """The policy set with its documents checked; PolicyError lists every problem."""
    return load_dir(directory, errors)
