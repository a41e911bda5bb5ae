"""The services' own flags on scripts/run_stack.py's command line (`make run ARGS="..."`), read from their parsers.

Every flag of the tokenizer service, the model service and the gateway is accepted by the launcher, built from
the services' own argparse parsers (tokenizer_service/__main__.py, model_service/__main__.py, gateway/__main__.py),
so a flag added to a service is accepted here with no change:

- by its own name, `--kv-tokens 4096`, when that name is not one of the launcher's own flags; a name several
  services take (`--otlp-endpoint`, `--grace-seconds`, `--tls-cert` ...) goes to each of them, unless its value
  must differ per service (a port or a unix socket: OWN_PER_SERVICE), which has only the prefixed form;
- by `--<service>-<flag>` (`--model-grace-seconds 30`, `--tokenizer-max-tokens 4096`, `--gateway-log-level
  debug`), to that one service only, after the plain forms (so it wins). This is the only form of a service flag
  whose plain name is the launcher's own (`--max-tokens`, `--startup-timeout`).

The flags the launcher sets itself (addresses, ports, unix sockets, the model files, the API key) keep their
launcher names: see MANAGED. Values are checked with the service's own type and choices before anything starts, then passed on
exactly as written.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def _tokenizer_parser() -> argparse.ArgumentParser:
    from tokenizer_service.__main__ import build_parser

    return build_parser()


def _model_parser() -> argparse.ArgumentParser:
    from model_service.__main__ import parser

    return parser()


def _gateway_parser() -> argparse.ArgumentParser:
    from gateway.__main__ import build_parser

    return build_parser()


# Per service, the flags the launcher derives from its own (launcher flag in the comment); --log-level is also
# given a prefixed form, so one service can log more than the others.
MANAGED: dict[str, frozenset[str]] = {
    "tokenizer": frozenset({"--model",  # --tokenizer (the SentencePiece file)
                            "--host", "--port", "--uds",  # --host, --tokenizer-port, --tokenizer-uds / --uds-dir
                            "--log-level", "--log-format"}),
    "model": frozenset({"--config", "--checkpoint", "--tokenizer", "--dtype", "--mesh", "--slots", "--compile-cache",
                        "--host", "--port", "--uds", "--metrics-port",  # --model-port, --model-uds, --model-metrics-port
                        "--log-level", "--log-format"}),
    "gateway": frozenset({"--tokenizer", "--model", "--model-metrics",  # the model's addresses (gRPC, metrics)
                          "--host", "--port", "--http-port", "--metrics-port",  # --gateway-port
                          "--uds", "--http-uds",  # --gateway-uds, --http-uds / --uds-dir (scripts/stack_endpoints.py)
                          "--log-level", "--log-format",
                          "--api-key"}),  # --api-key (passed in the environment, not on a command line)
}
PREFIXED_EVEN_IF_MANAGED = frozenset({"--log-level"})
# Flags naming what one process listens on: shared by several services, one value for all would collide.
OWN_PER_SERVICE = re.compile(r"-(port|uds|socket)$")
BUILDERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "tokenizer": _tokenizer_parser, "model": _model_parser, "gateway": _gateway_parser}
COMMANDS = {"tokenizer": "python -m tokenizer_service", "model": "python -m model_service",
            "gateway": "python -m gateway"}


@dataclass(frozen=True)
class PassThrough:
    """One launcher option that is passed on to one or more services as `flag`."""

    dest: str  # attribute in the launcher's namespace
    option: str  # as the launcher accepts it: --kv-tokens or --model-kv-tokens
    flag: str  # as the service accepts it: --kv-tokens
    services: tuple[str, ...]
    switch: bool  # a store_true flag: no value
    prefixed: bool  # --<service>-<flag>: passed after the plain forms, so it wins


def _long_option(action: argparse.Action) -> str | None:
    return next((o for o in action.option_strings if o.startswith("--")), None)


def service_actions(service: str) -> dict[str, argparse.Action]:
    """The service's flags by long option (--help left out)."""
    actions = {}
    for action in BUILDERS[service]()._actions:
        option = _long_option(action)
        if option and not isinstance(action, argparse._HelpAction):
            actions[option] = action
    return actions


def _checked(action: argparse.Action) -> Callable[[str], str]:
    """A type that checks a value as the service will, then keeps the text as written."""
    convert = action.type if callable(action.type) else None

    def check(raw: str) -> str:
        if convert is not None:
            convert(raw)
        return raw

    check.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid <name> value"
    return check


_ENV_NOTE = re.compile(r"\s*\[env [A-Z0-9_]+\]$")


def _help(actions: Sequence[argparse.Action], services: Sequence[str]) -> str:
    """Each distinct help text of the flag, after the services it comes from."""
    texts: dict[str, list[str]] = {}
    for action, service in zip(actions, services):
        text = _ENV_NOTE.sub("", action.help or "").replace("%", "%%")
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS:
            text += f" (default: {action.default})"
        texts.setdefault(text, []).append(service)
    return "; ".join(f"[{', '.join(names)}] {text}" for text, names in texts.items())


def _add(group: argparse._ArgumentGroup, option: str, actions: Sequence[argparse.Action], services: Sequence[str],
         shown: bool) -> str:
    """Add `option` with the value checks of the first of `actions` (the same flag of each of `services`)."""
    action = actions[0]
    help_text = _help(actions, services) if shown else argparse.SUPPRESS
    if isinstance(action, argparse._StoreTrueAction):
        added = group.add_argument(option, action="store_true", default=argparse.SUPPRESS, help=help_text)
    else:
        added = group.add_argument(option, type=_checked(action), choices=action.choices, default=argparse.SUPPRESS,
                                   metavar=None if action.choices else action.dest.upper(),
                                   help=help_text)
    return added.dest


def add_service_flags(parser: argparse.ArgumentParser) -> tuple[PassThrough, ...]:
    """Add every service flag to `parser` (after the launcher's own) and return how each is passed on."""
    own = {o for action in parser._actions for o in action.option_strings}
    actions = {service: service_actions(service) for service in BUILDERS}
    unmanaged = {service: [o for o in found if o not in MANAGED[service]] for service, found in actions.items()}
    takers: dict[str, list[str]] = {}
    for service, options in unmanaged.items():
        for option in options:
            takers.setdefault(option, []).append(service)
    passes: list[PassThrough] = []
    plain = parser.add_argument_group(
        "the services' flags", "Passed on to the service(s) in brackets; each is also accepted as --SERVICE-FLAG "
        "(e.g. --model-grace-seconds), for that one service only. See docs/running.md.")
    for option, services in takers.items():
        if option in own or (len(services) > 1 and OWN_PER_SERVICE.search(option)):
            continue  # reachable only by its prefixed form: the launcher's own name, or one value per service
        found = [actions[service][option] for service in services]
        dest = _add(plain, option, found, services, shown=True)
        passes.append(PassThrough(dest, option, option, tuple(services), _is_switch(found[0]), prefixed=False))
    for service, found in actions.items():
        group = parser.add_argument_group(f"{service} only, as --{service}-FLAG ({COMMANDS[service]} --help)")
        for option, action in found.items():
            if option in MANAGED[service] and option not in PREFIXED_EVEN_IF_MANAGED:
                continue
            prefixed = f"--{service}-{option[2:]}"
            plain = option not in own and option not in MANAGED[service] and not (
                len(takers.get(option, [])) > 1 and OWN_PER_SERVICE.search(option))
            shown = not plain  # shown in --help where no plain form reaches this service's flag
            dest = _add(group, prefixed, [action], [service], shown)
            passes.append(PassThrough(dest, prefixed, option, (service,), _is_switch(action), prefixed=True))
    return tuple(passes)


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction)


def service_args(args: argparse.Namespace, passes: Iterable[PassThrough], service: str) -> list[str]:
    """The command-line arguments the launcher's options give `service`: plain forms, then prefixed ones."""
    out: list[str] = []
    for pass_ in sorted((p for p in passes if service in p.services), key=lambda p: p.prefixed):
        if not hasattr(args, pass_.dest):
            continue
        value = getattr(args, pass_.dest)
        if pass_.switch:
            out += [pass_.flag] if value else []
        else:
            out += [pass_.flag, value]
    return out
