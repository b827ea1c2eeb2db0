"""`poet certs init` and `poet certs issue`: the CA and the certificates of the fleet's mutual TLS."""

from __future__ import annotations

import argparse

from host.cli.common import EXIT_OK, CliError, Console, add_json_arg, directory_path, positive_int


def cmd_certs_init(args, console: Console) -> int:
    from host.fleet.certs import CertError, init_certs

    try:
        bundle = init_certs(args.dir, args.host, force=args.force, valid_days=args.valid_days)
    except CertError as error:
        raise CliError(str(error)) from None
    return _report(console, args, role="coordinator", name="coordinator", bundle=bundle,
                   note=f"CA key: {args.dir}/ca.key (keep it on this machine); coordinator: poet serve --certs {bundle}")


def cmd_certs_issue(args, console: Console) -> int:
    from host.fleet.certs import CertError, issue_cert

    role, name = ("node", args.node) if args.node is not None else ("operator", args.operator)
    try:
        bundle = issue_cert(args.dir, name, role, valid_days=args.valid_days, force=args.force)
    except CertError as error:
        raise CliError(str(error)) from None
    use = "poet-agent run --certs" if role == "node" else "POET_CERTS="
    return _report(console, args, role=role, name=name, bundle=bundle, note=f"copy {bundle}/ to the {role}; {use} {bundle}")


def _report(console: Console, args, *, role: str, name: str, bundle, note: str) -> int:
    files = {f: str(bundle / f) for f in ("ca.pem", "cert.pem", "key.pem")}
    if args.json:
        console.print_json({"role": role, "name": name, "bundle_dir": str(bundle), "files": files})
    else:
        console.print(f"{role} {name}: {bundle}/ (ca.pem, cert.pem, key.pem)")
        console.log(note)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="create the fleet's CA and its certificates (mutual TLS)",
                           description="Create the fleet's certificate authority and the certificates of the "
                                       "coordinator, nodes and operators. A certificate names its holder: "
                                       "CN=NAME and the URI SAN poet://ROLE/NAME.")
    groups = certs.add_subparsers(dest="certs_command", required=True, metavar="SUBCOMMAND")

    init = groups.add_parser("init", help="create the CA and the coordinator's certificate",
                             description="Create DIR/ca.pem and DIR/ca.key (the CA) and the coordinator's bundle "
                                         "DIR/coordinator/ (SANs: localhost, 127.0.0.1 and each --host).")
    init.add_argument("--dir", type=directory_path, required=True, metavar="DIR", help="certificate directory")
    init.add_argument("--host", action="append", default=[], metavar="NAME",
                      help="a host name or IP address agents dial the coordinator at, repeatable "
                           "(default: only localhost and 127.0.0.1)")
    init.add_argument("--force", action="store_true",
                      help="replace an existing CA (every certificate it signed stops working)")
    init.add_argument("--valid-days", type=positive_int, default=825, metavar="DAYS",
                      help="validity of the coordinator's certificate (default: 825)")
    add_json_arg(init)
    init.set_defaults(func=cmd_certs_init)

    issue = groups.add_parser("issue", help="issue a node's or an operator's certificate",
                              description="Write the bundle DIR/NAME/ (ca.pem, cert.pem, key.pem), signed by the "
                                          "CA in DIR.")
    issue.add_argument("--dir", type=directory_path, required=True, metavar="DIR",
                       help="certificate directory made by `poet certs init`")
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", metavar="NAME", help="a board's name (the agent's identity)")
    who.add_argument("--operator", metavar="NAME", help="an operator's name (may submit runs and manage the fleet)")
    issue.add_argument("--force", action="store_true", help="replace an existing bundle of that name")
    issue.add_argument("--valid-days", type=positive_int, default=825, metavar="DAYS",
                       help="validity (default: 825)")
    add_json_arg(issue)
    issue.set_defaults(func=cmd_certs_issue)
