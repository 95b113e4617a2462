"""One rank of a 2-rank `llmstack train`-like run whose rank SLOW_RANK reads its data slowly
(SLOW_S seconds per micro-batch), for tests/test_fault_signals.py's straggler test.

    python tests/straggler_rank.py RUN_CONFIG DS_CONFIG SLOW_RANK SLOW_S   # under a launcher
"""

import sys
import time
from collections.abc import Iterator
from typing import Any

from llmstack.training import Trainer, load_run_config
from llmstack.training.distributed import shutdown_distributed


class SlowData:
    """The training data, each micro-batch `delay_s` late."""

    def __init__(self, data: Any, delay_s: float) -> None:
        self.data, self.delay_s = data, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)

    def micro_batches(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for batch in self.data.micro_batches(*args, **kwargs):
            time.sleep(self.delay_s)
            yield batch


def main(config: str, ds_config: str, slow_rank: int, slow_s: float) -> int:
    trainer = Trainer(load_run_config(config), ds_config_path=ds_config)
    if trainer.rank == slow_rank:
        trainer.train_data = SlowData(trainer.train_data, slow_s)
    trainer.train()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    config, ds_config, slow_rank, slow_s = (a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    sys.exit(main(config, ds_config, int(slow_rank), float(slow_s)))
