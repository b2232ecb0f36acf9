"""XML namespaces of the specs the gateway speaks, one place for all of them."""

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"
WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
WSSE11 = "http://docs.oasis-open.org/wss/oasis-wss-wssecurity-secext-1.1.xsd"
DS = "http://www.w3.org/2000/09/xmldsig#"
XENC = "http://www.w3.org/2001/04/xmlenc#"
XENC11 = "http://www.w3.org/2009/xmlenc11#"
EXC_C14N = "http://www.w3.org/2001/10/xml-exc-c14n#"
WSA = "http://www.w3.org/2005/08/addressing"
WSA_2004 = "http://schemas.xmlsoap.org/ws/2004/08/addressing"  # the member submission, still widely sent
ADDRESSING = (WSA, WSA_2004)
WSAM = "http://www.w3.org/2007/05/addressing/metadata"  # WS-Addressing 1.0 Metadata: the wsam:Addressing assertion
# Service descriptions: WSDL 1.1 and its SOAP bindings, XML Schema, WS-Policy, WS-SecurityPolicy.
WSDL = "http://schemas.xmlsoap.org/wsdl/"
WSDL_SOAP11 = "http://schemas.xmlsoap.org/wsdl/soap/"
WSDL_SOAP12 = "http://schemas.xmlsoap.org/wsdl/soap12/"
XSD = "http://www.w3.org/2001/XMLSchema"
WSP = "http://www.w3.org/ns/ws-policy"  # WS-Policy 1.5
WSP_2004 = "http://schemas.xmlsoap.org/ws/2004/09/policy"  # WS-Policy 1.2
SP11 = "http://schemas.xmlsoap.org/ws/2005/07/securitypolicy"
SP12 = "http://docs.oasis-open.org/ws-sx/ws-securitypolicy/200702"

# Token profile URIs.
X509V3 = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-x509-token-profile-1.0#X509v3"
X509_SKI = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-x509-token-profile-1.0#X509SubjectKeyIdentifier"
THUMBPRINT_SHA1 = "http://docs.oasis-open.org/wss/oasis-wss-soap-message-security-1.1#ThumbprintSHA1"
ENCKEY_SHA1 = "http://docs.oasis-open.org/wss/oasis-wss-soap-message-security-1.1#EncryptedKeySHA1"
ENCKEY_TOKEN = "http://docs.oasis-open.org/wss/oasis-wss-soap-message-security-1.1#EncryptedKey"
BASE64 = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-soap-message-security-1.0#Base64Binary"
# WS-Security names no token type for a pre-shared key: a wsse:Reference URI="#<key name>" with this ValueType
# names one (WSS4J hands the name, without '#', and this type to its CallbackHandler as a SECRET_KEY lookup).
PRE_SHARED_KEY = "urn:wsgate:ws-security:PreSharedKey"
# SAML Token Profile 1.1: the assertion namespaces and how an STR names an assertion (by its ID, as text).
SAML2 = "urn:oasis:names:tc:SAML:2.0:assertion"
SAML1 = "urn:oasis:names:tc:SAML:1.0:assertion"
SAML_ID = "http://docs.oasis-open.org/wss/oasis-wss-saml-token-profile-1.1#SAMLID"  # SAML 2.0
SAML_ASSERTION_ID = "http://docs.oasis-open.org/wss/oasis-wss-saml-token-profile-1.0#SAMLAssertionID"  # SAML 1.1
SAML_V2_TOKEN = "http://docs.oasis-open.org/wss/oasis-wss-saml-token-profile-1.1#SAMLV2.0"
SAML_V11_TOKEN = "http://docs.oasis-open.org/wss/oasis-wss-saml-token-profile-1.1#SAMLV1.1"
PASSWORD_TEXT = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-username-token-profile-1.0#PasswordText"
PASSWORD_DIGEST = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-username-token-profile-1.0#PasswordDigest"

ALL = {
    "soap": SOAP11,
    "soap12": SOAP12,
    "wsse": WSSE,
    "wsu": WSU,
    "wsse11": WSSE11,
    "ds": DS,
    "xenc": XENC,
    "xenc11": XENC11,
    "ec": EXC_C14N,
    "wsa": WSA,
}


def q(ns: str, local: str) -> str:
    """Clark notation, as lxml wants tags: {ns}local."""
    return f"{{{ns}}}{local}"


# SAML 2.0 subject confirmation methods.
SAML2_SENDER_VOUCHES = "urn:oasis:names:tc:SAML:2.0:cm:sender-vouches"
SAML2_BEARER = "urn:oasis:names:tc:SAML:2.0:cm:bearer"
SAML2_HOLDER_OF_KEY = "urn:oasis:names:tc:SAML:2.0:cm:holder-of-key"
XSI = "http://www.w3.org/2001/XMLSchema-instance"
