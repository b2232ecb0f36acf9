"""Token keys in the Kubernetes render (gateway/control/kubernetes.py): what a filter pod needs to open the PKCS#11
tokens its policies name (docs/keys.md "In Kubernetes").

The policies' pkcs11: URIs say it all: the module's library (`module-path`: it must be in the image, the vendor's
client or Debian's softhsm2 in an image built on the project's), and where each PIN comes from. A Secret made by
kustomize's secretGenerator from files the operator puts in DIR/keys/ (never rendered) holds the PINs and the
modules' configuration files: a `pin-source=file:/path` PIN is mounted at that very path, a `pin-source=env:NAME`
PIN is the variable NAME from the Secret, and a module's configuration file is mounted under CONFIG_MOUNT with the
variable that names it set (SoftHSM2's SOFTHSM2_CONF by default; another module's with `--pkcs11-config
ENV=FILE`). A network HSM is reached on the ports `--hsm-port` opens in the filters' NetworkPolicy."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from filters.engine.wss import token
from gateway.policy import PolicyError

SECRET = "wsgate-filter-pkcs11"
VOLUME = "pkcs11"
CONFIG_MOUNT = "/etc/wsgate/pkcs11"
# A module's file name -> the variable naming its configuration file, and that file's name in keys/.
KNOWN_CONFIGS = {"libsofthsm2.so": ("SOFTHSM2_CONF", "softhsm2.conf")}
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


@dataclass
class Tokens:
    """What the filter pod gets: Secret keys (each a file in keys/ of the same name), volumes, mounts, env."""

    secret_keys: list[str] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)

    def add_file(self, key: str, path: str) -> None:
        if not _SECRET_KEY.fullmatch(key):
            raise PolicyError(f"{path}: its file name must be letters, digits, '-', '.' or '_' (a Secret key)")
        if key in self.secret_keys:
            if not any(m["mountPath"] == path for m in self.mounts):
                raise PolicyError(f"{path}: another PIN or configuration file has the same name {key!r}")
            return
        self.secret_keys.append(key)
        self.mounts.append({"name": VOLUME, "mountPath": path, "subPath": key, "readOnly": True})


def tokens(uris: dict[str, str], configs: dict[str, str], reserved: tuple[str, ...]) -> Tokens | None:
    """`uris`: pkcs11: URI -> where the policies name it (for messages); `configs`: ENV -> file name in keys/ for
    modules not in KNOWN_CONFIGS (they apply to every module); `reserved`: mounts a PIN file may not sit under."""
    if not uris:
        return None
    out = Tokens()
    env_values: dict[str, str] = {}
    for uri, where in sorted(uris.items()):
        try:
            ref = token.parse_uri(uri)
        except ValueError as exc:
            raise PolicyError(f"{where}: {exc}") from None
        kind, _, source = ref.pin_source.partition(":")
        if kind == "env":
            if source not in env_values:
                env_values[source] = source
                out.secret_keys.append(source)
                out.env.append({"name": source, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": source}}})
        else:
            path = source.removeprefix("//")
            if not path.startswith("/") or any(path == r or path.startswith(f"{r}/") for r in reserved):
                raise PolicyError(f"{where}: pin-source file:{path}: the PIN file must be an absolute path outside "
                                  f"{', '.join(reserved)} (it is mounted there from the {SECRET} Secret)")  # fmt: skip
            out.add_file(PurePosixPath(path).name, path)
        known = KNOWN_CONFIGS.get(PurePosixPath(ref.module).name)
        for name, file in [*([known] if known and known[0] not in configs else []), *configs.items()]:
            mount = f"{CONFIG_MOUNT}/{file}"
            out.add_file(file, mount)
            if name not in env_values:
                env_values[name] = mount
                out.env.append({"name": name, "value": mount})
    out.volumes.append({"name": VOLUME, "secret": {"secretName": SECRET, "defaultMode": 0o440}})
    return out


def egress(ports: tuple[int, ...]) -> list[dict[str, Any]]:
    """The filters' NetworkPolicy egress to a network HSM (a NetworkPolicy cannot name a host: its ports)."""
    return [{"ports": [{"protocol": "TCP", "port": p} for p in ports]}] if ports else []
