"""The control plane: the `wsgate` CLI, the supervisor, Envoy's and Kubernetes' configuration, the WSDLs
served on ?wsdl."""
