"""The trainer's side: trajectories read from the buffer, as token ids and loss masks.

    converter = SampleConverter(tokenizer)          # analyses the chat template once
    samples = converter.convert_many(trajectories)  # every sample: one per trajectory, or per branch
    branches = converter.convert_all(trajectory)    # every sample of one trajectory (its branches)
    sample = converter.convert(trajectory)          # its one sample, or to_training_sample(...)
    converter.counts                                # samples by metadata["source"], and "refused"

The tokenizer is any Hugging Face tokenizer with a chat template. transformers is needed only to make one:
nothing here imports it, so the service installs and runs without it (it is the ``train`` extra).

    sample.py     TrainingSample, its status, SampleConversionError
    template.py   what the chat template writes around an assistant turn (probed once per converter)
    rerender.py   the text path: where each message's text lies in the rendered conversation
    spans.py      the text path: what the model generated of each generated message
    sampled.py    the text path's corrections: what a template writes that the model did not sample
    masking.py    the loss mask over the tokens, from those character spans
    turns.py      samples from the engine's token records (``turns``), one per branch; no tokenizer needed
    converter.py  SampleConverter, to_training_sample: the paths (token records, engine tokens, re-tokenising)
"""

from buffer.trainer.samples.converter import SampleConverter, to_training_sample
from buffer.trainer.samples.sample import SampleConversionError, SampleStatus, TrainingSample, sample_status
from buffer.trainer.samples.template import ChatTemplateAnalysis, analyse_chat_template
from buffer.trainer.samples.turns import samples_from_turns

__all__ = [
    "ChatTemplateAnalysis",
    "SampleConversionError",
    "SampleConverter",
    "SampleStatus",
    "TrainingSample",
    "analyse_chat_template",
    "sample_status",
    "samples_from_turns",
    "to_training_sample",
]
