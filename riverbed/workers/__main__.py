"""``python -m riverbed.workers ROLE… [--name N]``: a worker without the CLI's extras (used by tests)."""

from __future__ import annotations

import argparse
import sys

from riverbed.errors import RiverbedError
from riverbed.logs import configure_logging
from riverbed.settings import Settings
from riverbed.workers.main import parse_roles, run_process, run_worker


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m riverbed.workers")
    parser.add_argument("roles", nargs="+")
    parser.add_argument("--name")
    parser.add_argument("--park-after", type=float, default=60.0)
    args = parser.parse_args()
    try:
        settings = Settings.from_env()
        configure_logging(settings.log_format, settings.log_level)
        roles = parse_roles(args.roles, model_configured=settings.model_configured)
        run_process(lambda: run_worker(roles, settings, name=args.name, park_after=args.park_after))
    except RiverbedError as exc:
        sys.exit(f"riverbed worker: {exc}")


if __name__ == "__main__":
    main()
