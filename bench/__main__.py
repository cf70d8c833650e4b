"""``python -m bench``: run every benchmark module and print one table."""

from __future__ import annotations

import importlib

import anyio

from bench.common import MODULES, Result, options, print_results, private_redis


def main() -> int:
    args = options("Run every riverbed benchmark against its baseline.").parse_args()
    results: list[Result] = []
    with private_redis(args.redis_url) as url:
        for name in MODULES:
            module = importlib.import_module(name)
            results += anyio.run(module.measure, url, args)
    print_results(results, as_json=args.json)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
