"""This process's random-number states as JSON, so a resumed run draws the numbers (dropout masks)
the uninterrupted run would have drawn: Python's, NumPy's global, torch's CPU generator, the
accelerator's, and DeepSpeed's RNG tracker (the tensor-parallel streams, llmstack.parallel.random)."""

import base64
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from llmstack.compat.deepspeed import rng_tracker


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # the legacy tuple (numpy's stub says dict)
    accelerator = get_accelerator()
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],  # type: ignore[attr-defined]
        "torch": _encode(torch.get_rng_state()),
        "accelerator": None if accelerator.device_name() == "cpu" else _encode(accelerator.get_rng_state()),
        "tracker": {name: _encode(state) for name, state in rng_tracker().get_states().items()},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(state["torch"]))
    if state["accelerator"] is not None:
        get_accelerator().set_rng_state(_decode(state["accelerator"]))
    if state["tracker"]:
        rng_tracker().set_states({name: _decode(s) for name, s in state["tracker"].items()})
