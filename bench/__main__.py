"""``python -m bench [NAME...]``: run every benchmark module (or the named ones) and print one table."""

from __future__ import annotations

import importlib
import sys
import time

import anyio

from bench.common import MODULES, Result, options, print_results, private_redis, stop_on_sigterm


def main() -> int:
    stop_on_sigterm()
    parser = options("Run every riverbed benchmark against its baseline.")
    parser.add_argument("names", nargs="*", help=f"run only these ({', '.join(m.split('.')[1] for m in MODULES)})")
    args = parser.parse_args()
    wanted = [f"bench.{name}" for name in args.names] or list(MODULES)
    unknown = [name for name in wanted if name not in MODULES]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0].split('.')[1]!r}")
    results: list[Result] = []
    with private_redis(args.redis_url) as url:
        for name in wanted:
            started = time.perf_counter()
            module = importlib.import_module(name)
            results += anyio.run(module.measure, url, args)
            print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print_results(results, as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
