"""MIME packages: multipart/related messages (MTOM/XOP, SOAP with Attachments), docs/attachments.md."""
