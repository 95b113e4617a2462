"""`llmstack sweep`: short proxy runs over a grid or a random search; ranking, table and PNG."""

import contextlib
import os
import signal
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmstack.cli.output import result_stdout
from llmstack.errors import UserError
from llmstack.hparams.grid import grid_trials, parse_grid, parse_range, random_trials
from llmstack.hparams.sweep import (
    RESULTS_FILE,
    Sweep,
    best_overrides,
    format_ranking,
    grid_heatmap,
    plot_results,
    run_sweep,
)


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config YAML every trial starts from")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="section.key=V1,V2,...",
        help="values of one key (repeat for more keys: every combination is a trial)",
    )
    p.add_argument(
        "--range",
        action="append",
        default=[],
        metavar="section.key=LOW:HIGH[:log]",
        help="a range to sample with --samples (uniform, or log-uniform with :log; integers for integer bounds)",
    )
    p.add_argument("--samples", type=int, help="random search: this many trials drawn from the --range and --grid axes")
    p.add_argument("--seed", type=int, default=0, help="seed of the random search's draws (default 0)")
    p.add_argument("--steps", type=int, required=True, help="training steps of each trial (train.max_steps)")
    p.add_argument("--parallel", type=int, default=1, help="trials run at once (default 1; CPU threads are shared)")
    p.add_argument("--out", help="sweep directory (default: runs/sweep-CONFIG_NAME)")
    p.add_argument("--best", action="store_true", help="print only the winning trial's overrides")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides for every trial")


def build_sweep(args: Namespace) -> tuple[Sweep, list[Any]]:
    """The sweep the arguments describe, and its grid axes (for the heat map)."""
    choices = [parse_grid(spec) for spec in args.grid]
    ranges = [parse_range(spec) for spec in args.range]
    if args.samples is not None:
        trials = random_trials(choices, ranges, args.samples, args.seed)
        choices = []  # a random search has no grid to draw
    elif ranges:
        raise UserError("--range needs --samples K (the number of trials to draw)")
    elif choices:
        trials = grid_trials(choices)
    else:
        raise UserError("give at least one --grid section.key=V1,V2 (or --range with --samples)")
    return Sweep(args.config, args.steps, trials, list(args.overrides)), choices


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the sweep like Ctrl-C: the running trials are stopped, the table kept."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: Namespace) -> int:
    sweep, choices = build_sweep(args)
    out_dir = args.out or os.path.join("runs", f"sweep-{Path(args.config).stem}")
    with result_stdout() as stdout:
        try:
            with sigterm_interrupts():
                rows = run_sweep(sweep, out_dir, args.parallel)
        except KeyboardInterrupt:
            print(f"llmstack sweep: interrupted; rerun the same command to continue {out_dir}", file=sys.stderr)
            return 130
        png = plot_results(rows, out_dir, grid_heatmap(rows, choices))
        print(f"llmstack sweep: {os.path.join(out_dir, RESULTS_FILE)}, {png}", file=sys.stderr)
        keys = list(dict.fromkeys(k for trial in sweep.trials for k in trial))
        print(best_overrides(rows) if args.best else format_ranking(rows, keys), file=stdout)
    return 0
