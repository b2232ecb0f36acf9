"""The demo's gateway keys in a SoftHSM2 token (`wsgate certs init --hsm`; the tests' token too).

SoftHSM2 (Debian `softhsm2`) keeps its tokens in a directory named by its configuration file, found through
SOFTHSM2_CONF: everything lands in `out` (softhsm2.conf, softhsm-tokens/, hsm-pin), the token labelled `wsgate`
holds gateway-sign and gateway-enc imported from the demo PKI. The policies then name the keys by their pkcs11:
URIs (`uri`). A real HSM is set up by its vendor's tools instead (docs/keys.md)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

MODULE_PATHS = ("/usr/lib/softhsm/libsofthsm2.so", "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so")
TOKEN = "wsgate"
KEYS = {"gateway-sign": "01", "gateway-enc": "02"}  # key label (the PKI's file stem) -> CKA_ID


def module_path() -> str:
    for path in MODULE_PATHS:
        if Path(path).exists():
            return path
    raise FileNotFoundError("SoftHSM2's module is not installed (Debian: apt-get install softhsm2)")


def conf_path(out: Path) -> Path:
    return Path(out) / "softhsm2.conf"


def uri(out: Path, label: str) -> str:
    """The pkcs11: URI of the key `label` in the token `init` made in `out` (its PIN in out/hsm-pin)."""
    pin = (Path(out) / "hsm-pin").resolve()
    return f"pkcs11:token={TOKEN};object={label}?module-path={module_path()}&pin-source=file:{pin}"


def init(out: Path, pki: Path, force: bool = False) -> Path:
    """A SoftHSM2 token in `out` holding the demo PKI's gateway keys (unless there already, or `force`).
    Returns the configuration file, for SOFTHSM2_CONF."""
    out, pki = Path(out).resolve(), Path(pki).resolve()
    conf, tokens, pin_file = conf_path(out), out / "softhsm-tokens", out / "hsm-pin"
    if conf.exists() and pin_file.exists() and not force:
        return conf
    util = shutil.which("softhsm2-util")
    if util is None:
        raise FileNotFoundError("softhsm2-util not found (Debian: apt-get install softhsm2)")
    shutil.rmtree(tokens, ignore_errors=True)
    tokens.mkdir(parents=True, mode=0o700)
    conf.write_text(f"directories.tokendir = {tokens}\nobjectstore.backend = file\nlog.level = ERROR\n")
    pin = secrets.token_hex(12)
    pin_file.write_text(pin + "\n")
    pin_file.chmod(0o600)
    env = {**os.environ, "SOFTHSM2_CONF": str(conf)}

    def run(*args: str) -> None:
        # The PINs go on softhsm2-util's command line (its only way): a throw-away demo token, never a real one.
        subprocess.run([util, *args], env=env, check=True, capture_output=True)

    run("--init-token", "--free", "--label", TOKEN, "--pin", pin, "--so-pin", secrets.token_hex(12))
    for label, key_id in KEYS.items():
        run("--import", str(pki / f"{label}.key"), "--token", TOKEN, "--label", label, "--id", key_id, "--pin", pin)
    return conf


def init_demo(out: Path, force: bool = False) -> Path:
    """The token for the demo PKI in `out`, and out/hsm.env: SOFTHSM2_CONF and the pkcs11: URIs the demo policy
    reads (WSGATE_SIGNING_KEY, WSGATE_DECRYPTION_KEY). Returns hsm.env."""
    conf = init(out, out, force=force)
    env = Path(out) / "hsm.env"
    env.write_text(
        f"SOFTHSM2_CONF={conf}\n"
        f"WSGATE_SIGNING_KEY='{uri(out, 'gateway-sign')}'\n"
        f"WSGATE_DECRYPTION_KEY='{uri(out, 'gateway-enc')}'\n"
    )
    return env
