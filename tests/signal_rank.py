"""One rank of a job that trains nothing, for tests of how signals and exits reach a job
(tests/test_fault_signals.py): steps of a few milliseconds under the FaultGuard, then, when the
ranks agree to stop, a 'save' that takes SAVE_S seconds and ends by writing `saved{rank}`.

    python tests/signal_rank.py OUT_DIR SAVE_S [COLLECTIVE_TIMEOUT_S]   # under a launcher, or as one process
"""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from llmstack.errors import UserError
from llmstack.training.distributed import init_distributed, peer_failures_reported, shutdown_distributed
from llmstack.training.faults import FaultGuard


def main(out: Path, save_s: float, collective_timeout_s: float) -> int:
    with peer_failures_reported():
        rank, _ = init_distributed(collective_timeout_s)
        import deepspeed.comm

        # DeepSpeed's CPU all-reduce works on after its /dev/shm names are gone.
        total = torch.ones(4)
        deepspeed.comm.inference_all_reduce(total)
        cfg = SimpleNamespace(max_nonfinite_steps=1, loss_spike_factor=0.0, loss_spike_window=1, sigterm_grace_s=60)
        guard = FaultGuard(cfg, fp16=False, device="cpu")
        with guard:
            (out / f"ready{rank}").write_text(f"{os.getpid()} {total[0].item():g}")
            step = 0
            while True:
                step += 1
                time.sleep(0.005)
                verdict = guard.after_step(step, 1.0, True, False)
                if verdict.save:
                    time.sleep(save_s)
                    (out / f"saved{rank}").write_text(str(step))
                    break
        shutdown_distributed()
    (out / f"exit{rank}").write_text(str(128 + verdict.stop_signal))
    return 128 + verdict.stop_signal


if __name__ == "__main__":
    try:
        out, save_s, *timeout = (a for a in sys.argv[1:] if not a.startswith("--local_rank"))
        sys.exit(main(Path(out), float(save_s), float(timeout[0]) if timeout else 1800.0))
    except UserError as e:  # as the llmstack command reports it
        print(f"signal_rank: error: {e}", file=sys.stderr)
        sys.exit(2)
