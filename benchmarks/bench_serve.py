"""Serving throughput and latency: N concurrent streaming clients through ``slotinfer serve`` (or any
OpenAI-compatible ``--url``) against the in-process Inferencer on the same workload.

    python benchmarks/bench_serve.py --clients 1,8,32            # same as: slotinfer bench --serve
    python benchmarks/bench_serve.py --url http://127.0.0.1:8080 --no-in-process   # another server

See slotinfer/cli/bench_serve.py for the workload and docs/serve.md for the figures.
"""

import argparse
import sys

from slotinfer.cli.bench import add_arguments
from slotinfer.cli.bench_serve import run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
