"""XML hygiene: parsing limits, canonicalization, charsets, namespaces, SOAP envelopes, WSDL and schemas."""
