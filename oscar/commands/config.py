"""`python -m oscar config [overrides...] [--output PATH] [--format yaml|json|flat]`

Prints (or writes, only when the content changed) the resolved configuration that every verb
composes from `conf/`. An invalid override fails naming the bad key or value.
"""

from __future__ import annotations

import argparse
import json
import sys

from oscar.config import ConfigError, compose, dump_yaml, flatten, to_dict, write_resolved


def main(argv: list[str]) -> int:
    """Compose, validate and show the configuration; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="python -m oscar config", description=__doc__.splitlines()[0],
                                     epilog="example: python -m oscar config model=qwen2.5-coder-0.5b method=quarot --format flat")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=qwen2.5-coder-0.5b method=quarot")
    parser.add_argument("--output", help="write the resolved YAML here (atomically, only when changed)")
    parser.add_argument("--format", choices=("yaml", "json", "flat"), default="yaml")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.overrides)
    except ConfigError as exc:
        print(f"oscar config: {exc}", file=sys.stderr)
        return 2
    if args.output:
        changed = write_resolved(cfg, args.output)
        print(f"oscar config: {'wrote' if changed else 'unchanged'} {args.output}")
        return 0
    if args.format == "yaml":
        sys.stdout.write(dump_yaml(cfg))
    elif args.format == "json":
        print(json.dumps(to_dict(cfg), indent=1, sort_keys=True))
    else:
        for key, value in sorted(flatten(cfg).items()):
            print(f"{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}")
    return 0
