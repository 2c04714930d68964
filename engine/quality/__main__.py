"""`python -m engine.quality eval ...`: the same command as `splitserve eval`."""

import argparse
import sys

from engine.quality.cli import add_eval_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.quality")
    add_eval_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
