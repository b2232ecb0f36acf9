"""`wsgate keys rotate`: a new HMAC pre-shared key or SecureConversation master key in its YAML file, or an old one
retired (docs/keys.md "Rotation"). The file is rewritten whole (a temporary file renamed over it, mode 0600); the
workers read it on their next reload. No key is ever printed."""

from __future__ import annotations

import base64
import os
import re
import secrets
from pathlib import Path

import yaml

_NAME = re.compile(r"[^\W\d][\w.\-]*")  # a pre-shared key's name travels as a reference's fragment (an NCName)
_KEY_ID = re.compile(r"[A-Za-z0-9_\-]{1,32}")


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    os.replace(tmp, path)


def _fresh() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


def master_keys(path: Path, new_id: str | None = None, retire: str | None = None) -> str:
    """Add a new sealing key first (the old ones still open the contexts they sealed), or retire `retire` (once its
    contexts have expired: lifetime_s). Returns what was done."""
    doc = yaml.safe_load(path.read_text())
    entries: list[dict] = doc["keys"]
    ids = [e["id"] for e in entries]
    if retire is not None:
        if retire not in ids:
            raise ValueError(f"{path}: no master key {retire!r}")
        if len(entries) == 1:
            raise ValueError(f"{path}: {retire!r} is the only master key")
        doc["keys"] = [e for e in entries if e["id"] != retire]
        _write(path, doc)
        return f"retired master key {retire}; {doc['keys'][0]['id']} seals"
    new_id = new_id or next(f"k{n}" for n in range(len(ids) + 1, len(ids) + 100) if f"k{n}" not in ids)
    if not _KEY_ID.fullmatch(new_id) or new_id in ids:
        raise ValueError(f"{path}: master key id {new_id!r} is taken or not 1-32 letters, digits, '_' or '-'")
    doc["keys"] = [{"id": new_id, "key": _fresh()}, *entries]
    _write(path, doc)
    return f"master key {new_id} seals new contexts; {', '.join(ids)} still open theirs"


def hmac_keys(path: Path, name: str | None = None, retire: str | None = None) -> str:
    """Add the pre-shared key `name` (its clients get it out of band, then send its name), or retire `retire`."""
    doc = yaml.safe_load(path.read_text())
    entries: dict[str, str] = doc["keys"]
    if retire is not None:
        if retire not in entries:
            raise ValueError(f"{path}: no key {retire!r}")
        if len(entries) == 1:
            raise ValueError(f"{path}: {retire!r} is the only key")
        del entries[retire]
        _write(path, doc)
        return f"retired pre-shared key {retire}"
    if not name or not _NAME.fullmatch(name) or name in entries:
        raise ValueError(f"{path}: key name {name!r} is taken or not an XML NCName")
    entries[name] = _fresh()
    _write(path, doc)
    return f"added pre-shared key {name}: give it to its clients, then retire the one it replaces"
