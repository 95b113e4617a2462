"""Training checkpoints through the DeepSpeed engine, plus what DeepSpeed does not know.

Layout of `OUT_DIR/checkpoints/`:
    config.json, tokenizer files, run_config.yaml   the model config and tokenizer (for export)
    global_step{N}/                                 DeepSpeed's shards (ZeRO-partitioned states)
    latest                                          the tag of the newest checkpoint (DeepSpeed's)

The client state saved with each checkpoint holds the step and the number of samples consumed,
which is all the data stream needs to continue exactly.
"""

import os

import torch.distributed as dist
import yaml

from llmstack.errors import UserError

# Lets DeepSpeed's ds_to_universal convert our checkpoints for resuming on another world size.
UNIVERSAL_CHECKPOINT_INFO = {"universal_checkpoint_version": 0.2}


class CheckpointManager:
    def __init__(self, directory, trainer):
        self.directory = directory
        self.trainer = trainer

    def save(self):
        t = self.trainer
        if t.rank == 0:
            self.write_model_files()
        client_state = {
            "step": t.step,
            "consumed_samples": t.consumed_samples,
            "universal_checkpoint_info": UNIVERSAL_CHECKPOINT_INFO,
        }
        t.engine.save_checkpoint(self.directory, tag=f"global_step{t.step}", client_state=client_state)
        dist.barrier()

    def write_model_files(self):
        os.makedirs(self.directory, exist_ok=True)
        self.trainer.model_config.save_pretrained(self.directory)
        self.trainer.tokenizer.save_pretrained(self.directory)
        with open(os.path.join(self.directory, "run_config.yaml"), "w") as f:
            yaml.safe_dump(self.trainer.run.to_dict(), f, sort_keys=False)

    def load(self, which="auto"):
        """Load "auto" (the newest checkpoint, or None if there is none) or a checkpoint path."""
        if which == "auto":
            if not os.path.isfile(os.path.join(self.directory, "latest")):
                return None
            directory, tag = self.directory, None
        else:
            path = os.path.normpath(which)
            if not os.path.isdir(path):
                raise UserError(f"checkpoint {which} not found")
            if os.path.isfile(os.path.join(path, "latest")):
                directory, tag = path, None
            else:
                directory, tag = os.path.dirname(path), os.path.basename(path)
        loaded, client_state = self.trainer.engine.load_checkpoint(directory, tag=tag)
        if loaded is None:
            raise UserError(f"could not load a checkpoint from {which}")
        return client_state
