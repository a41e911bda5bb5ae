"""Command-line flags that also read an environment variable (the flag wins).

Every service names its variables `GROK_<SERVICE>_<FLAG>`: `--metrics-port` of the model service is
`GROK_MODEL_METRICS_PORT`. Defaults, types and choices are checked by argparse for both sources.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to `<prefix>_<FLAG>` environment variables."""

    def __init__(self, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kwargs)
        self.env_prefix = env_prefix

    def env_name(self, flag: str) -> str:
        return f"{self.env_prefix}_{flag.lstrip('-').replace('-', '_').upper()}"

    def add_env_argument(self, flag: str, **kwargs: Any) -> argparse.Action:
        """Add `flag`; its default comes from the environment when the variable is set."""
        env = self.env_name(flag)
        help_text = kwargs.pop("help", "")
        kwargs["help"] = f"{help_text} [env {env}]".strip()
        if env in os.environ:
            raw = os.environ[env]
            if kwargs.get("action") == "store_true":
                kwargs["default"] = parse_bool(raw, env)
            else:
                kwargs["default"] = raw
                kwargs.pop("required", None)
        return self.add_argument(flag, **kwargs)


UDS_HELP = ("listen on this unix socket file instead of --host/--port (clients dial unix:PATH); created "
            "owner-only (0600), removed at exit; an existing file at PATH is refused, never replaced")


def add_uds_flag(parser: EnvArgumentParser, flag: str = "--uds", help_text: str = UDS_HELP) -> None:
    """`--uds PATH` (vLLM's and uvicorn's name): the service listens on a unix socket (serving_common.uds)."""
    parser.add_env_argument(flag, default=None, metavar="PATH", help=help_text)


def parse_bool(raw: str, name: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise SystemExit(f"{name}={raw!r} is not a boolean (use true/false)")


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive integer")
    return value


def port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw} is not a TCP port (0..65535; 0 picks a free one)")
    return value
