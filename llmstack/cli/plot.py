"""`llmstack plot RUN_DIR`: training curves to PNG from the run's metrics.jsonl."""

from argparse import ArgumentParser, Namespace

from llmstack.monitor.plot import plot_run


def add_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("run_dir", help="output directory of a training run (holds metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/metrics.png)")


def run(args: Namespace) -> None:
    print(plot_run(args.run_dir, args.out))
