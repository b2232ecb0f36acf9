"""SOAP faults: the one shape every rejection takes.

A `SecurityFault` carries the WS-Security fault code the client sees with a generic message, and the precise
reason that only goes to the log and the metrics (never to the client: no oracle, no key material)."""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from filters.engine import ns

# WS-Security 1.0 section 12 fault codes and their generic client messages.
WSSE_CODES: dict[str, str] = {
    "UnsupportedSecurityToken": "An unsupported token was provided",
    "UnsupportedAlgorithm": "An unsupported signature or encryption algorithm was used",
    "InvalidSecurity": "An error was discovered processing the <wsse:Security> header",
    "InvalidSecurityToken": "An invalid security token was provided",
    "FailedAuthentication": "The security token could not be authenticated or authorized",
    "FailedCheck": "The signature or decryption was invalid",
    "SecurityTokenUnavailable": "Referenced security token could not be retrieved",
    "MessageExpired": "The message has expired",
}

# WS-SecureConversation fault codes (the namespace is chosen by the context's spec version).
WSC_CODES: dict[str, str] = {
    "BadContextToken": "The requested context elements are insufficient or unsupported",
    "UnsupportedContextToken": "Not all of the values associated with the SCT are supported",
    "UnknownDerivationSource": "The specified source for the derivation is unknown",
    "RenewNeeded": "The provided context token has expired",
    "UnableToRenew": "The specified context token could not be renewed",
}


@dataclass(eq=False)
class Fault(Exception):
    """A refusal. `code` is the QName local part, `code_ns` its namespace (None: a plain SOAP code).

    `sender` picks Client/Sender (the request is at fault) or Server/Receiver."""

    code: str
    reason: str  # precise, for the log and metrics only
    message: str = ""  # generic, for the client
    code_ns: str | None = None
    http_status: int = 500
    sender: bool = True

    def __post_init__(self) -> None:
        super().__init__(self.reason)
        if not self.message:
            self.message = WSSE_CODES.get(self.code) or WSC_CODES.get(self.code) or "The request was refused"


def security(code: str, reason: str) -> Fault:
    """A WS-Security fault (wsse:code)."""
    assert code in WSSE_CODES, code
    return Fault(code=code, reason=reason, code_ns=ns.WSSE)


def client(reason: str, message: str = "The request is not a valid SOAP message", status: int = 500) -> Fault:
    """A plain SOAP Client/Sender fault: the message itself is malformed or not allowed."""
    return Fault(code="", reason=reason, message=message, http_status=status)


def server(reason: str, message: str = "The gateway could not process the message", status: int = 500) -> Fault:
    return Fault(code="", reason=reason, message=message, http_status=status, sender=False)


# Metric labels for plain (code-less) faults: the reason's fixed opening -> its class. Reasons carry client-chosen
# text and numbers ("envelope has 7 Body elements"), so a label is never taken from them: every distinct attack
# would be a new time series. A reason not listed counts as `malformed` (sender) or `internal` (receiver).
REASON_CLASSES: tuple[tuple[str, str], ...] = (
    ("busy", "busy"),
    ("body too large", "body too large"),
    ("backend response refused", "backend response refused"),
    ("schema invalid", "schema"),
    ("content-length not a number", "content-length not a number"),
    ("request without a body", "request without a body"),
    ("method ", "method not allowed"),
    ("DTD", "dtd"),
    ("processing instruction", "processing instruction"),
    ("nesting depth over", "limit"),
    ("element count over", "limit"),
    ("attribute count over", "limit"),
    ("text node longer than", "limit"),
    ("replay store unavailable", "store unavailable"),
    ("security context store unavailable", "store unavailable"),
    ("key token unavailable", "token unavailable"),
    ("mime: ", "mime"),
)
LABELS = frozenset({*WSSE_CODES, *WSC_CODES, *(label for _, label in REASON_CLASSES), "malformed", "internal"})


def metric_reason(fault: Fault) -> str:
    """The fault's metric label, always one of `LABELS`: its WS-Security/WS-SC code, or its reason's class.
    The precise reason goes to the log only."""
    if fault.code in WSSE_CODES or fault.code in WSC_CODES:
        return fault.code
    for opening, label in REASON_CLASSES:
        if fault.reason.startswith(opening):
            return label
    return "malformed" if fault.sender else "internal"


def render(fault: Fault, soap_version: str) -> bytes:
    """Serialize a fault as a SOAP 1.1 or 1.2 envelope (`soap_version` is "1.1" or "1.2")."""
    msg = escape(fault.message)
    if soap_version == "1.2":
        top = "env:Sender" if fault.sender else "env:Receiver"
        sub = ""
        decl = ""
        if fault.code and fault.code_ns:
            decl = f' xmlns:sec="{fault.code_ns}"'
            sub = f"<env:Subcode><env:Value>sec:{fault.code}</env:Value></env:Subcode>"
        body = (
            f'<env:Envelope xmlns:env="{ns.SOAP12}"{decl}><env:Body><env:Fault>'
            f"<env:Code><env:Value>{top}</env:Value>{sub}</env:Code>"
            f'<env:Reason><env:Text xml:lang="en">{msg}</env:Text></env:Reason>'
            "</env:Fault></env:Body></env:Envelope>"
        )
    else:
        if fault.code and fault.code_ns:
            decl = f' xmlns:sec="{fault.code_ns}"'
            code = f"sec:{fault.code}"
        else:
            decl = ""
            code = "soap:Client" if fault.sender else "soap:Server"
        body = (
            f'<soap:Envelope xmlns:soap="{ns.SOAP11}"{decl}><soap:Body><soap:Fault>'
            f"<faultcode>{code}</faultcode><faultstring>{msg}</faultstring>"
            "</soap:Fault></soap:Body></soap:Envelope>"
        )
    return body.encode()


def content_type(soap_version: str) -> str:
    return "application/soap+xml; charset=utf-8" if soap_version == "1.2" else "text/xml; charset=utf-8"
