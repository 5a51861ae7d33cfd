"""What every command that talks to a running daemon shares: its flags (where the daemon is, how
long to wait, CURVE keys) and the one call made with them. `memd keygen` makes the keys."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List

from memd.client import DaemonUnavailable, curve, protocol
from memd.client import call as client_call


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="E", help="daemon endpoint (default: as the client picks it)")
    parser.add_argument("--timeout", metavar="S", type=positive_seconds, default=2.0,
                        help="seconds to wait for the daemon (> 0)")
    parser.add_argument("--server-key", metavar="KEY", help="the daemon's CURVE public key: 40 Z85 characters "
                        "or its .key file (default: $%s)" % curve.SERVER_KEY_ENV)
    parser.add_argument("--client-key", metavar="FILE", help="this client's CURVE .key_secret file, listed in the "
                        "daemon's curve_client_keys_dir (default: $%s)" % curve.CLIENT_KEY_FILE_ENV)


def endpoint(args: argparse.Namespace) -> str:
    return args.endpoint or protocol.default_endpoint()


def call(op: str, args: argparse.Namespace, **fields: Any) -> Dict[str, Any]:
    """``op`` at the daemon the flags name; raises DaemonUnavailable (also for unusable keys)."""
    return client_call(op, endpoint=endpoint(args), timeout=args.timeout, server_key=args.server_key,
                       client_key_file=args.client_key, **fields)


def follow(ask: Callable[[Any], Dict[str, Any]], items: str, cursor: Callable[[Any], bool]) -> Dict[str, Any]:
    """Every page of a paged reply (`curves`, `status`: memd.pages): ``ask(after)`` is one
    request, None for the first page; the first reply with ``items`` holding every page's, in
    order. ``cursor`` says whether a reply's next is one. Raises DaemonUnavailable on a reply
    that is unreadable or does not advance (a daemon that would have it ask for ever)."""
    first = None
    shown: List[Any] = []
    after = None
    while True:
        reply = ask(after)
        entries, following = reply.get(items), reply.get("next")
        if not isinstance(entries, list):
            raise DaemonUnavailable("unreadable %s reply: no list of %s" % (items, items))
        first = reply if first is None else first
        shown += entries
        if following is None:
            return dict(first, **{items: shown, "next": None})
        if not cursor(following):
            raise DaemonUnavailable("unreadable %s reply: next is %r" % (items, following))
        if not entries or (after is not None and following <= after):
            raise DaemonUnavailable("the daemon's pages of %s did not advance (at %r)" % (items, following))
        after = following


def asker(op: str, args: argparse.Namespace) -> Callable[[Any], Dict[str, Any]]:
    """One page of ``op`` at the daemon the flags name: ``ask(after)`` as follow() takes it."""
    return lambda after: call(op, args, **({} if after is None else {"after": after}))


def paged(op: str, args: argparse.Namespace, items: str, cursor: Callable[[Any], bool]) -> Dict[str, Any]:
    """``op``'s reply at the daemon the flags name, every page of it (follow)."""
    return follow(asker(op, args), items, cursor)


def session_number(value: Any) -> bool:
    """A `status` reply's next: a session number."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def positive_seconds(text: str) -> float:
    """--timeout: a number of seconds above 0 (argparse names the flag when this refuses)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a number of seconds" % text) from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("%s is not between 0 (excluded) and 3600 seconds" % text)
    return value


def add_keygen(sub) -> None:
    p = sub.add_parser("keygen", help="write a CURVE keypair (NAME.key, NAME.key_secret) for a tcp:// endpoint")
    p.add_argument("directory", metavar="DIR", help="where to write them (made if missing)")
    p.add_argument("name", metavar="NAME", help="the files' name: 'server' for the daemon, a user or host for a client")
    p.set_defaults(run=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    try:
        public_file, secret_file = curve.write_keypair(args.directory, args.name)
    except FileExistsError as exc:
        print("memd: %s" % exc.args[0], file=sys.stderr)
        return 2
    except OSError as exc:
        print("memd: cannot write keys in %s: %s" % (args.directory, exc.strerror or exc), file=sys.stderr)
        return 2
    public = curve.read_public_key(public_file, "key file").decode()
    public_file, secret_file = os.path.abspath(public_file), os.path.abspath(secret_file)
    print("public key: %s" % public)
    print("wrote %s (public: give it away)\n  and %s (secret: mode 0600, keep it)" % (public_file, secret_file))
    print("as the daemon's: curve_secret_key_file = \"%s\"; clients pass --server-key %s (or %s=%s)"
          % (secret_file, public_file, curve.SERVER_KEY_ENV, public))
    print("as a client's:   copy %s into the daemon's curve_client_keys_dir; pass --client-key %s (or %s)"
          % (os.path.basename(public_file), secret_file, curve.CLIENT_KEY_FILE_ENV))
    return 0
