"""Extra certificate authorities that the guard's browsers trust (`sfguard start --ca-file PEM`).

Intranet sites, a company network that inspects TLS and HTTPS test sites carry certificates
from a private authority. The guard's browsers, and only they, trust the authorities given to
the guard, besides the system's: never system-wide, never another program, and certificate
checks stay on (`--ignore-certificate-errors` is never used).

How: Chromium on Linux reads the NSS database in `$HOME/.pki/nssdb`. A guard with extra
authorities gives every browser a HOME of its own (a browser user already has one) and builds
that database there with `certutil` (Debian's libnss3-tools), each authority trusted to issue
server certificates ("C,,") and nothing else. The HOME goes with the browser when it closes.

The files are read and checked once, at start (`CaBundle.load`): each must hold one or more PEM
certificates of an authority (basic constraints CA:TRUE), none expired. A bad file stops
`sfguard start` with the file and the fault named.
"""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from sfguard.errors import SfguardError

#: Largest CA file read (a bundle of a few hundred authorities stays far below).
MAX_CA_FILE = 4 * 1024 * 1024
#: How long one certutil call may take.
CERTUTIL_TIMEOUT = 20.0


class TrustError(SfguardError):
    """A CA file that cannot be used, or a browser's certificate store that cannot be made."""


@dataclass(frozen=True)
class Authority:
    subject: str          # the authority's common name (or whole subject)
    sha256: str           # the certificate's SHA-256 fingerprint, hex
    not_after: str        # ISO date
    source: str           # the file it came from
    pem: bytes

    def public(self) -> dict[str, str]:
        return {"subject": self.subject, "sha256": self.sha256, "not_after": self.not_after,
                "source": self.source}


@dataclass(frozen=True)
class CaBundle:
    authorities: tuple[Authority, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.authorities)

    def describe(self) -> str:
        return ", ".join(f"{a.subject} (sha256 {a.sha256[:16]}...)" for a in self.authorities) or "none"

    def public(self) -> list[dict[str, str]]:
        return [a.public() for a in self.authorities]

    @classmethod
    def load(cls, paths: list[str] | list[Path], now: datetime.datetime | None = None) -> CaBundle:
        """Read and check the CA files; TrustError names the file and the fault."""
        now = now or datetime.datetime.now(datetime.UTC)
        found: list[Authority] = []
        for p in paths:
            path = Path(p)
            try:
                with open(path, "rb") as fh:
                    data = fh.read(MAX_CA_FILE + 1)
            except OSError as exc:
                raise TrustError(f"--ca-file {path}: cannot be read ({exc.strerror or exc})") from None
            if len(data) > MAX_CA_FILE:
                raise TrustError(f"--ca-file {path}: larger than {MAX_CA_FILE // (1024 * 1024)} MiB")
            try:
                certs = x509.load_pem_x509_certificates(data)
            except ValueError:
                raise TrustError(f"--ca-file {path}: no PEM certificate in it "
                                 "(expected -----BEGIN CERTIFICATE----- blocks)") from None
            for cert in certs:
                found.append(_authority(cert, path, now))
        unique: dict[str, Authority] = {}
        for a in found:                    # the same authority in two files: once
            unique.setdefault(a.sha256, a)
        return cls(tuple(unique.values()))


def _authority(cert: x509.Certificate, path: Path, now: datetime.datetime) -> Authority:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    subject = str(names[0].value) if names else cert.subject.rfc4514_string()
    try:
        ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        ca = False
    if not ca:
        raise TrustError(f"--ca-file {path}: {subject!r} is not a certificate authority "
                         "(no basic constraints CA:TRUE); give the authority that issued the site's "
                         "certificate, not the site's own")
    if cert.not_valid_after_utc < now:
        raise TrustError(f"--ca-file {path}: {subject!r} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    return Authority(subject=subject, sha256=cert.fingerprint(hashes.SHA256()).hex(),
                     not_after=cert.not_valid_after_utc.date().isoformat(), source=str(path),
                     pem=cert.public_bytes(Encoding.PEM))


def certutil() -> str | None:
    return shutil.which("certutil")


def install(bundle: CaBundle, home: Path, uid: int | None = None, gid: int | None = None) -> Path:
    """Build the NSS database of a browser whose HOME is `home` with `bundle`'s authorities;
    owned by `uid`/`gid` (the browser user) when given. Blocking (run it in a thread)."""
    tool = certutil()
    if tool is None:
        raise TrustError("certutil is not installed (Debian: apt-get install libnss3-tools); "
                         "it is needed to give the browsers the --ca-file authorities")
    pki = home / ".pki"
    db = pki / "nssdb"
    for d in (pki, db):
        os.mkdir(d, 0o700)
    where = f"sql:{db}"
    _certutil(tool, ["-N", "-d", where, "--empty-password"])
    for i, auth in enumerate(bundle.authorities):
        _certutil(tool, ["-A", "-d", where, "-t", "C,,", "-a", "-n", f"sfguard-ca-{i}-{auth.sha256[:12]}"],
                  stdin=auth.pem)
    if uid is not None:
        for folder, _, files in os.walk(pki):
            os.chown(folder, uid, gid if gid is not None else -1)
            for name in files:
                os.chown(os.path.join(folder, name), uid, gid if gid is not None else -1)
    for f in db.iterdir():
        os.chmod(f, 0o600)
    return db


def _certutil(tool: str, args: list[str], stdin: bytes | None = None) -> None:
    try:
        r = subprocess.run([tool, *args], input=stdin, capture_output=True, timeout=CERTUTIL_TIMEOUT,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"})
    except subprocess.TimeoutExpired:
        raise TrustError(f"certutil {args[0]} did not finish in {CERTUTIL_TIMEOUT:.0f} s") from None
    if r.returncode != 0:
        detail = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()
        raise TrustError(f"certutil {args[0]} failed: {detail[-1] if detail else r.returncode}")


def trusted_in(db: Path) -> list[str]:
    """The nicknames of the authorities in a browser's NSS database (for tests and doctor)."""
    tool = certutil()
    if tool is None:
        return []
    r = subprocess.run([tool, "-L", "-d", f"sql:{db}"], capture_output=True, text=True, timeout=CERTUTIL_TIMEOUT)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith("sfguard-ca-")]
