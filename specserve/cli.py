"""`specserve` command line: generate, serve, bench offline/steps/serve (``server.cli``) and train prompts/data/glide/
falcon/accept-head/bigram/eval-glide (``training.cli``). The server never imports the training package: this module
is the one place that knows both."""
from __future__ import annotations

import argparse
import sys

import server.cli
import training.cli
from server.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible server with lossless "
                                "speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)
    server.cli.add_commands(sub)
    training.cli.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = ["specserve", *argv]  # the command as typed, for benchmark records
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
