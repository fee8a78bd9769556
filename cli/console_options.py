"""The console's reach options of `sfguard start` (checked by supervisor/console/listen.py);
`sfguard service print` takes the same ones for its unit."""
from __future__ import annotations

from sfguard.cli.errors import CliError


def add(p) -> None:
    p.add_argument("--console-url", metavar="URL",
                   help="the address people open, used in every console link: "
                        "https://NAME[:PORT] (a name its certificate covers, or a TLS proxy's); "
                        "needed when --console listens on 0.0.0.0 or ::")
    p.add_argument("--console-tls-cert", metavar="PEM",
                   help="serve the console over TLS with this certificate (chain) ...")
    p.add_argument("--console-tls-key", metavar="PEM",
                   help="... and its private key (no passphrase; mode 0600 or stricter)")
    p.add_argument("--console-trusted-proxy", metavar="ADDRESS",
                   help="a reverse proxy in front of the console: only it (and this machine) "
                        "may connect, and only its X-Forwarded-Proto and X-Forwarded-For count")
    p.add_argument("--console-plain-http", action="store_true",
                   help="with --console-public and no TLS: serve plain HTTP on the network "
                        "anyway (links and cookies cross it in clear)")


def config(args):
    """The console's ConsoleConfig from `sfguard start`'s arguments (exit 2 when wrong)."""
    from sfguard.supervisor.console.listen import ConsoleError, console_config
    if not 1 <= args.console_session <= 8 * 3600:
        raise CliError("--console-session wants a number of seconds from 1 to 28800", 2)
    try:
        return console_config(args.console, public=args.console_public, url=args.console_url,
                              tls_cert=args.console_tls_cert, tls_key=args.console_tls_key,
                              trusted_proxy=args.console_trusted_proxy,
                              plain_http=args.console_plain_http,
                              session_ttl=float(args.console_session))
    except ConsoleError as exc:
        raise CliError(str(exc), 2) from None
