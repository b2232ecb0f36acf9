"""What talks to Redis or the network, and the factory that builds it from a route: replay stores, security
context stores, revocation (CRL files, OCSP), the UsernameToken failure throttle."""
