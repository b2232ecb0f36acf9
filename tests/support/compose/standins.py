"""Stand-ins for the registry images that gateway/Dockerfile and docker-compose.yml name, built here from Debian.

No image registry is reachable from CI, so every base image the files use is made locally under its exact name:
a Debian bookworm root filesystem (mmdebstrap, Debian's mirror) imported as wsgate-standin/bookworm-slim, and on
it one recipe per official image (tests/support/compose/*.Dockerfile), keeping that image's contract (docs/compose.md
lists what differs). Each image carries a label with the hash of its recipe (its files, its version, the hash of
the images it is built from); an image whose label matches is kept, so a second run on the same machine builds
nothing. `python -m tests.support.compose.standins` builds what is missing and prints the sizes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.control import rate_limit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
BASE = "wsgate-standin/bookworm-slim"
LABEL = "org.wsgate.standin-recipe"
# The host's own trust anchors (added to Debian's bundle): CI reaches PyPI, crates.io and static.rust-lang.org
# through an egress proxy that presents certificates of its own CA, which the images' pip, cargo and rustup
# must trust as the host does. Empty on a machine without local anchors.
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# /usr merged by mmdebstrap's hook, as debian images are, rather than by the usrmerge package (which pulls in perl).
MERGED_USR = "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr"
# debian:*-slim's trims: no manuals, documentation (but the copyrights) or translations.
DPKG_EXCLUDES = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
)
NICE = ["nice", "-n", "10"]  # the machine is shared: image builds yield to everything else


@dataclass(frozen=True)
class Recipe:
    dockerfile: str
    files: tuple[str, ...]  # besides the Dockerfile, from this folder
    version_arg: str | None  # build argument that receives the tag's version
    parents: tuple[str, ...]  # the images its FROM lines name
    # Files of this machine copied into the build context (name there -> where it is), e.g. a binary built here.
    host_files: tuple[tuple[str, Callable[[], Path]], ...] = ()


# Keyed by repository; the tag (its version) comes from the files that name the image.
RECIPES = {
    "python": Recipe("python.Dockerfile", (), None, (BASE,)),
    "rust": Recipe("rust.Dockerfile", (), "RUST_VERSION", (BASE,)),
    "envoyproxy/envoy": Recipe(
        "envoy.Dockerfile", ("envoy-entrypoint.sh", "envoy-demo.yaml"), "ENVOY_VERSION", (BASE, "python:3.11-slim")
    ),
    "redis": Recipe("redis.Dockerfile", ("redis-entrypoint.sh",), None, (BASE,)),
    # The rate-limit service `make ratelimit` built from the Go module proxy at the commit go.mod pins (the tag's).
    "envoyproxy/ratelimit": Recipe("ratelimit.Dockerfile", (), None, (BASE,), (("ratelimit", rate_limit.binary),)),
}


def named_images() -> list[str]:
    """Every registry image the Dockerfile and the Compose file use, parents first."""
    dockerfile = (ROOT / "gateway" / "Dockerfile").read_text()
    names = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M) + re.findall(r"--from=(\S+:\S+)", dockerfile)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    names += [s["image"] for s in compose["services"].values() if "build" not in s and "image" in s]
    ordered = sorted(set(names), key=lambda n: (n.split(":")[0] != "python", n))  # envoy's recipe uses python
    return ordered


def recipe_for(name: str) -> tuple[Recipe, str]:
    repo, tag = name.rsplit(":", 1)
    if repo not in RECIPES:
        raise SystemExit(f"no stand-in recipe for {name}: add one to {HERE.relative_to(ROOT)}/")
    version = re.match(r"v?(\d+(?:\.\d+)*)", tag)
    assert version or not RECIPES[repo].version_arg, f"{name}: no version in the tag"
    return RECIPES[repo], version.group(1) if version else tag  # a tag may be a commit (envoyproxy/ratelimit)


def docker(*args: str, capture: bool = True) -> str:
    run = subprocess.run(["docker", *args], capture_output=capture, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed:\n{run.stderr if capture else ''}")
    return run.stdout if capture else ""


def label_of(image: str) -> str | None:
    run = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", image], capture_output=True, text=True
    )
    if run.returncode != 0:
        return None
    return (json.loads(run.stdout) or {}).get(LABEL)


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()


def local_cas() -> list[Path]:
    return sorted(LOCAL_CAS.glob("*.crt")) if LOCAL_CAS.is_dir() else []


def base_key() -> str:
    recipe = [SUITE, *MIRRORS, MERGED_USR, *DPKG_EXCLUDES]
    return digest(*recipe, *(p.read_bytes() for p in local_cas()))


def build_base(key: str) -> None:
    hooks = []
    if local_cas():
        hooks += [f"--customize-hook=mkdir -p $1{LOCAL_CAS}"]
        hooks += [f"--customize-hook=copy-in {p} {LOCAL_CAS}" for p in local_cas()]
        hooks += ['--customize-hook=chroot "$1" update-ca-certificates']
    debootstrap = [
        *NICE,
        "mmdebstrap",
        "--quiet",
        "--variant=minbase",
        "--include=ca-certificates",
        MERGED_USR,
        *(f"--dpkgopt={o}" for o in DPKG_EXCLUDES),
        *hooks,
        "--format=tar",
        SUITE,
        "-",
        *MIRRORS,
    ]
    changes = ['CMD ["bash"]', f"LABEL {LABEL}={key}"]
    importer = ["docker", "import", *(a for c in changes for a in ("--change", c)), "-", BASE]
    with tempfile.TemporaryFile() as log:
        with subprocess.Popen(debootstrap, stdout=subprocess.PIPE, stderr=log) as rootfs:
            assert rootfs.stdout is not None
            subprocess.run(importer, stdin=rootfs.stdout, check=True, stdout=subprocess.DEVNULL)
            rootfs.stdout.close()
        if rootfs.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"mmdebstrap failed ({rootfs.returncode}):\n{log.read().decode()[-4000:]}")


def image_key(name: str, keys: dict[str, str]) -> str:
    recipe, version = recipe_for(name)
    files = [(HERE / f).read_bytes() for f in (recipe.dockerfile, *recipe.files)]
    for _, source in recipe.host_files:
        if not source().is_file():
            raise SystemExit(f"{name}: its stand-in copies {source()}, which is not built (make ratelimit)")
        files.append(source().read_bytes())
    return digest(name, version, *files, *(keys[p] for p in recipe.parents))


def build_image(name: str, key: str) -> None:
    recipe, version = recipe_for(name)
    args = ["--build-arg", f"{recipe.version_arg}={version}"] if recipe.version_arg else []
    # The legacy builder, as docker-compose v1 uses: FROM and COPY --from find local images without a registry.
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    with tempfile.TemporaryDirectory() as context:
        for f in (recipe.dockerfile, *recipe.files):
            shutil.copy2(HERE / f, Path(context) / f)
        for target, source in recipe.host_files:
            shutil.copy2(source(), Path(context) / target)
        cmd = [*NICE, "docker", "build", "-q", "-f", str(Path(context) / recipe.dockerfile), *args]
        cmd += ["--label", f"{LABEL}={key}", "-t", name, context]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"building the stand-in {name} failed:\n{(run.stdout + run.stderr)[-4000:]}")


def ensure(log=print) -> dict[str, str]:
    """Builds every stand-in whose recipe changed; returns image name -> recipe hash."""
    keys = {BASE: base_key()}
    if label_of(BASE) != keys[BASE]:
        log(f"stand-in {BASE}: mmdebstrap {SUITE} ...")
        build_base(keys[BASE])
    for name in named_images():
        keys[name] = image_key(name, keys)
        if label_of(name) == keys[name]:
            log(f"stand-in {name}: cached")
            continue
        log(f"stand-in {name}: building ...")
        build_image(name, keys[name])
    return keys


def sizes(names: list[str]) -> dict[str, int]:
    return {n: int(docker("image", "inspect", "--format", "{{.Size}}", n).strip()) for n in names}


def main() -> None:
    keys = ensure()
    for name, size in sizes(list(keys)).items():
        print(f"{name:32} {size / 1e6:8.1f} MB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
