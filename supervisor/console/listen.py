"""Where the console listens and how people reach it (`sfguard start --console ...`), checked
before the guard starts (docs/decisions/0001-console-reach.md):

* `--console [HOST][:PORT]`: loopback unless `--console-public`; without a port, the one
  recorded in the home (`console.json`), else a free one that is then recorded;
* `--console-url URL`: the address its links use (a name, a proxy's address);
* `--console-tls-cert/--console-tls-key`: TLS served by the console itself;
* `--console-trusted-proxy ADDRESS`: a reverse proxy whose forwarded headers count;
* a non-loopback address without TLS needs `--console-plain-http`.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from sfguard.errors import SfguardError

log = logging.getLogger("sfguard.console")

#: the console's port, kept across restarts (`<home>/console.json`)
PORT_FILE = "console.json"
WILDCARDS = ("0.0.0.0", "::")


class ConsoleError(SfguardError):
    pass


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address (an IPv4-mapped IPv6 one as its IPv4), or None for a name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def parse_listen(value: str) -> tuple[str, int | None]:
    """`HOST`, `PORT`, `HOST:PORT`, `[V6]`, `[V6]:PORT` -> (host, port or None)."""
    text = value.strip()
    if text.isdigit():
        host, port = "127.0.0.1", text
    elif text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ConsoleError(f"--console wants [HOST][:PORT], got {value!r}")
        host, port = inner, rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""          # a host alone (an IPv6 literal without brackets too)
    host = host or "127.0.0.1"
    if host != "localhost" and _ip(host) is None:
        raise ConsoleError(f"--console: {host!r} is not an IP address (or localhost)")
    if port == "":
        return host, None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConsoleError(f"--console wants [HOST][:PORT] with a port from 0 to 65535, got {value!r}")
    return host, int(port)


def _public_url(url: str, tls: bool, proxy: str | None) -> tuple[str, str, int]:
    """`--console-url` -> (scheme, host, port), refused where the links would not work."""
    try:
        p = urlsplit(url.strip())
        port = p.port
    except ValueError:
        raise ConsoleError(f"--console-url: not a URL: {url!r}") from None
    if p.scheme not in ("http", "https") or not p.hostname:
        raise ConsoleError("--console-url wants http(s)://HOST[:PORT], e.g. https://guard.example.com")
    if p.username or p.password or p.query or p.fragment or p.path not in ("", "/"):
        raise ConsoleError("--console-url: only scheme, host and port (the console is served at "
                           "the root of its address; no path, user, query or fragment)")
    if tls and p.scheme != "https":
        raise ConsoleError("--console-url: the console serves TLS, so its URL is https://...")
    if p.scheme == "https" and not tls and proxy is None:
        raise ConsoleError("--console-url https://... while the console serves plain HTTP: that "
                           "is a TLS proxy in front of it; name it with --console-trusted-proxy "
                           "ADDRESS, or give the console its own certificate (--console-tls-cert)")
    return p.scheme, p.hostname.lower(), port or (443 if p.scheme == "https" else 80)


def _private_file(path: Path, what: str, private: bool) -> Path:
    try:
        st = path.stat()
    except OSError as exc:
        raise ConsoleError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConsoleError(f"{what} {path}: not a file")
    if private and st.st_mode & 0o077:
        raise ConsoleError(f"{what} {path} is readable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 it")
    return path


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The console's server context (TLS 1.2 and later). A key with a passphrase is refused
    (nothing prompts); an error names the files, never their contents."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    asked: list[bool] = []

    def no_passphrase() -> bytes:
        asked.append(True)
        return b""

    try:
        ctx.load_cert_chain(cert, key, password=no_passphrase)
    except (ssl.SSLError, OSError) as exc:
        why = ("the key is encrypted; give it without a passphrase (0600)" if asked
               else getattr(exc, "reason", None) or type(exc).__name__)
        raise ConsoleError(f"the console's TLS certificate {cert} and key {key} cannot be used: "
                           f"{why}") from None
    return ctx


def _cert_names(cert: Path) -> tuple[list[str], datetime.datetime]:
    from cryptography import x509
    c = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], c.not_valid_after_utc
    names = [n.lower() for n in san.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return names, c.not_valid_after_utc


def _covers(names: list[str], host: str) -> bool:
    for n in names:
        if n == host or (n.startswith("*.") and "." in host and host.split(".", 1)[1] == n[2:]
                         and _ip(host) is None):
            return True
    return False


@dataclass(frozen=True)
class ConsoleConfig:
    """What `sfguard start` decided about the console. `port` None: the recorded one."""
    host: str = "127.0.0.1"
    port: int | None = 0
    session_ttl: float = 8 * 3600.0
    url: str | None = None               # the public URL as given (scheme://host[:port])
    tls_cert: Path | None = None
    tls_key: Path | None = None
    trusted_proxy: str | None = None
    plain_http: bool = False
    warnings: tuple[str, ...] = ()
    tls_ctx: ssl.SSLContext | None = field(default=None, compare=False, repr=False)  # loaded once

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def public(self) -> tuple[str, str, int] | None:
        """(scheme, host, port) of --console-url, or None."""
        return None if self.url is None else _public_url(self.url, self.tls, self.trusted_proxy)

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return self.tls_ctx or tls_context(self.tls_cert, self.tls_key)


def console_config(listen: str, *, public: bool = False, url: str | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None,
                   trusted_proxy: str | None = None, plain_http: bool = False,
                   session_ttl: float = 8 * 3600.0) -> ConsoleConfig:
    """The console's options checked together; ConsoleError names the first that is wrong."""
    host, port = parse_listen(listen)
    local = is_loopback(host)
    if not local and not public:
        raise ConsoleError(f"--console {listen}: {host} is not a loopback address; the console "
                           "is for this machine's operator (add --console-public to listen there)")
    if (tls_cert is None) != (tls_key is None):
        raise ConsoleError("--console-tls-cert and --console-tls-key go together")
    cert = key = ctx = None
    if tls_cert is not None and tls_key is not None:
        cert = _private_file(Path(tls_cert).absolute(), "--console-tls-cert", private=False)
        key = _private_file(Path(tls_key).absolute(), "--console-tls-key", private=True)
        ctx = tls_context(cert, key)      # read once, here: what the console serves
    if not local and cert is None and not plain_http:
        raise ConsoleError(
            f"--console {listen}: sign-in links and session cookies would cross the network in "
            "clear. Give the console a certificate (--console-tls-cert, --console-tls-key), or "
            "keep it on 127.0.0.1 behind a TLS proxy (--console-url https://..., "
            "--console-trusted-proxy 127.0.0.1), or say --console-plain-http")
    if trusted_proxy is not None:
        proxy_ip = _ip(trusted_proxy)
        if proxy_ip is None:
            raise ConsoleError(f"--console-trusted-proxy wants an IP address, got {trusted_proxy!r}")
        if local and not proxy_ip.is_loopback:
            raise ConsoleError(f"--console-trusted-proxy {trusted_proxy} cannot reach a console "
                               f"on {host} (loopback)")
        trusted_proxy = str(proxy_ip)
    if url is None and host in WILDCARDS:
        raise ConsoleError(f"--console {listen} listens on every address: say which one people "
                           "open with --console-url, e.g. https://guard.example.com:8443")
    cfg = ConsoleConfig(host, port, float(session_ttl), url.strip().rstrip("/") if url else None,
                        cert, key, trusted_proxy, plain_http)
    warnings = []
    pub = cfg.public()
    if cert is not None:
        names, not_after = _cert_names(cert)
        want = pub[1] if pub else host
        if not _covers(names, want):
            raise ConsoleError(f"--console-tls-cert {cert} is for {', '.join(names) or 'no name'}, "
                               f"not {want}: browsers would refuse it")
        if not_after < datetime.datetime.now(datetime.UTC):
            warnings.append(f"the console's certificate expired on {not_after:%Y-%m-%d}")
    if pub is not None and trusted_proxy is None and port is not None and port != 0 and port != pub[2]:
        warnings.append(f"the console listens on port {port} but its URL says {pub[2]} (right "
                        "only behind a port forward)")
    if not local and not port:
        warnings.append("a console reached from elsewhere wants a fixed port: --console HOST:PORT")
    if not local and cert is None:
        warnings.append(f"the console listens on {host} over plain HTTP (--console-plain-http): "
                        "sign-in links and cookies cross the network in clear")
    return replace(cfg, warnings=tuple(warnings), tls_ctx=ctx)


def remembered_port(home: Path) -> int | None:
    """The console's port of the last start on this home, if recorded."""
    try:
        port = json.loads((home / PORT_FILE).read_text()).get("port")
    except (OSError, ValueError, AttributeError):
        return None
    return port if isinstance(port, int) and 0 < port <= 65535 else None


def remember_port(home: Path, port: int) -> None:
    from sfguard.supervisor.home import atomic_write
    try:
        atomic_write(home / PORT_FILE, json.dumps({"port": port}).encode() + b"\n", 0o600)
    except OSError as exc:        # the console works; the next start may pick another port
        log.warning("the console's port could not be recorded in %s: %s", home, exc.strerror)


def peer_allowed(peer: str | None, cfg: ConsoleConfig) -> bool:
    """With a trusted proxy, only it and this machine (loopback) may connect."""
    if cfg.trusted_proxy is None:
        return True
    ip = _ip(peer or "")
    return ip is not None and (str(ip) == cfg.trusted_proxy or ip.is_loopback)
