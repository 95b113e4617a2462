"""Export of a multi-task model's sequence-classification head, with the trunk, to the stock
`AutoModelForSequenceClassification` of its family: LlamaForSequenceClassification (or Mistral's,
Qwen2's) for a decoder trunk, EuroBertForSequenceClassification (classifier_pooling "bos") for an
encoder trunk. The head's parameter names are the stock class's (llmstack.models.multitask), so the
weights pass through under them; the stock config is the trunk's with the task's num_labels.
"""

from typing import cast

from transformers import AutoModelForSequenceClassification, EuroBertForSequenceClassification, PreTrainedModel

from .configuration_encoder import LLMStackEncoderConfig
from .encoder_interop import to_eurobert_config
from .hf_interop import to_hf_config
from .multitask import LLMStackForMultitask, classification_state_dict


def to_sequence_classification(model: LLMStackForMultitask, task: str, family: str) -> PreTrainedModel:
    """The stock `family` sequence classifier computing `task`'s logits as `model` does (same dtype);
    ValueError naming what does not fit (the task, the family, the architecture)."""
    config = model.config
    weights = classification_state_dict(model, task)  # refuses a task that is not a sequence classification
    num_labels = next(int(t["num_labels"]) for t in config.tasks if t["name"] == task)
    if config.causal == (family == "eurobert"):
        kind, needs = ("a decoder", "llama, mistral or qwen2") if config.causal else ("an encoder", "eurobert")
        raise ValueError(f"the multi-task trunk is {kind}: export its classifier with --format {needs}")
    if config.causal:
        hf_config = to_hf_config(config, family)
        hf_config.num_labels = num_labels
        hf = AutoModelForSequenceClassification.from_config(hf_config)
    else:
        eurobert = to_eurobert_config(cast(LLMStackEncoderConfig, config))
        eurobert.num_labels, eurobert.classifier_pooling = num_labels, "bos"
        hf = EuroBertForSequenceClassification(eurobert)
    hf = hf.to(model.dtype)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or any(not name.endswith("_proj.bias") for name in missing):
        raise ValueError(f"{family} sequence classifier does not match: missing {missing}, unexpected {unexpected}")
    for name in missing:  # EuroBERT's o_proj bias, which the llmstack trunk lacks
        hf.get_parameter(name).data.zero_()
    return cast(PreTrainedModel, hf)
