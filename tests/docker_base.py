"""A local base image for the Docker test, made from Debian's own packages: tests only.

Docker Hub cannot be reached from these machines, and HTTPS from inside a build passes a proxy
with a CA of its own. So the test builds the product's ``docker/Dockerfile`` ``FROM`` a base made
here, in three steps, each cached:

1. ``local/bookworm:base``: ``debootstrap --variant=minbase bookworm`` from the mirror apt uses,
   imported as an image (skipped when the tag exists);
2. on it, in layers of their own: Python 3.11 with venv (Debian's packages), the host's extra CA
   certificates (``/usr/local/share/ca-certificates``) trusted, and the CPU torch wheel in
   ``/wheels`` with ``PIP_FIND_LINKS`` pointing there;
3. tagged ``TEST_BASE``, which ``docker build --build-arg BASE=...`` takes.

Nothing of this goes into the product's Dockerfile. A second run rebuilds nothing: the base is
skipped by its tag, and the layers' inputs (the certificates and the wheel, kept in one cache
directory) are the same bytes, so Docker's cache answers every step.

    python -m tests.docker_base            # prints the base's tag and image id
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEBIAN_BASE = "local/bookworm:base"
TEST_BASE = "local/ray-profiler-test-base:bookworm"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "ray-profiler", "docker-base")
CA_DIR = "/usr/local/share/ca-certificates"
TORCH_SPEC = "torch==2.13.0"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

BASE_DOCKERFILE = """\
FROM {debian}
RUN apt-get update \\
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
# The host's extra CA (HTTPS here passes a proxy with its own): test base only.
COPY certs/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
# The CPU build of torch, which the package registry does not have.
COPY wheels/ /wheels/
ENV PIP_FIND_LINKS=/wheels
"""


class BaseError(RuntimeError):
    """The base could not be made; the message says which step and why."""


def run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    """``cmd``, its output captured; BaseError naming it when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        raise BaseError(f"{' '.join(cmd[:3])} ... took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise BaseError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{tail}")
    return proc


def image_id(tag: str) -> str | None:
    """The id of the image tagged ``tag``; None when there is none."""
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", tag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 or one-line sources)."""
    for path in ["/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"]:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        m = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(
            r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s+bookworm\b", text, re.M
        )
        if m:
            return m.group(1)
    return DEFAULT_MIRROR


def debian_base() -> str:
    """``DEBIAN_BASE``, bootstrapped from Debian's packages unless it exists."""
    if image_id(DEBIAN_BASE):
        return DEBIAN_BASE
    if shutil.which("debootstrap") is None:
        if os.geteuid() != 0:
            raise BaseError("debootstrap is not installed (apt-get install debootstrap, as root)")
        run(["apt-get", "install", "-y", "-q", "debootstrap"], timeout=600)
    with tempfile.TemporaryDirectory(prefix="rootfs-") as rootfs:
        run(
            ["debootstrap", "--variant=minbase", "bookworm", rootfs, debian_mirror()],
            timeout=1200,
        )
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        try:
            run(["docker", "import", "-", DEBIAN_BASE], timeout=600, stdin=tar.stdout)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait(timeout=60)
    return DEBIAN_BASE


def torch_wheel(dest: str) -> str:
    """The CPU torch wheel in ``dest``: ``TORCH_WHEEL`` if set, else ``pip download``'s."""
    found = glob.glob(os.path.join(dest, "torch-*.whl"))
    if found:
        return found[0]
    given = os.environ.get("TORCH_WHEEL")
    if given:
        shutil.copy(given, dest)
        return os.path.join(dest, os.path.basename(given))
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", TORCH_SPEC, "-d", tmp],
            timeout=1800,
        )
        (wheel,) = glob.glob(os.path.join(tmp, "torch-*.whl"))
        if "+cpu" not in os.path.basename(wheel):
            raise BaseError(
                f"pip download {TORCH_SPEC} gave {os.path.basename(wheel)}, not a CPU build: "
                "set TORCH_WHEEL to a CPU wheel's path"
            )
        shutil.move(wheel, dest)
    return os.path.join(dest, os.path.basename(wheel))


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def build_context(cache: str = CACHE) -> str:
    """The base's build context in ``cache``, with the same bytes from run to run."""
    certs, wheels = os.path.join(cache, "certs"), os.path.join(cache, "wheels")
    os.makedirs(certs, exist_ok=True)
    os.makedirs(wheels, exist_ok=True)
    want = {os.path.basename(p): p for p in glob.glob(os.path.join(CA_DIR, "*.crt"))}
    for name in set(os.listdir(certs)) - set(want):
        os.remove(os.path.join(certs, name))
    for name, path in want.items():
        with open(path, "rb") as f:
            data = f.read()
        target = os.path.join(certs, name)
        if _read(target) != data:
            with open(target, "wb") as f:
                f.write(data)
    if not want:  # COPY needs a file; an empty marker keeps the layer the same
        open(os.path.join(certs, "none.txt"), "w").close()
    torch_wheel(wheels)
    with open(os.path.join(cache, "Dockerfile"), "w") as f:
        f.write(BASE_DOCKERFILE.format(debian=DEBIAN_BASE))
    return cache


def ensure_test_base(cache: str = CACHE) -> tuple[str, bool]:
    """``TEST_BASE`` built (or found in Docker's cache); (its tag, whether its id changed)."""
    before = image_id(TEST_BASE)
    debian_base()
    context = build_context(cache)
    run(["docker", "build", "-q", "-t", TEST_BASE, context], timeout=1800)
    return TEST_BASE, image_id(TEST_BASE) != before


if __name__ == "__main__":
    try:
        tag, rebuilt = ensure_test_base()
    except BaseError as exc:
        sys.exit(f"error: {exc}")
    print(f"{tag} {image_id(tag)} ({'built' if rebuilt else 'unchanged: every step cached'})")
