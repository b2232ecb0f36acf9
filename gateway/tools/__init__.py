"""Tools around the gateway: the WS-Security client, the demo backend, WSDL import."""
