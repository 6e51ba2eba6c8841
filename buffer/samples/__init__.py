"""The trainer's side: trajectories read from the buffer, as token ids and loss masks.

    converter = SampleConverter(tokenizer)          # analyses the chat template once
    samples = converter.convert_many(trajectories)  # or to_training_sample(trajectory, tokenizer)

The tokenizer is any Hugging Face tokenizer with a chat template. transformers is needed only to make one:
nothing here imports it, so the service installs and runs without it (it is the ``train`` extra).

    sample.py     TrainingSample, its status, SampleConversionError
    template.py   what the chat template writes around an assistant turn (probed once per converter)
    rerender.py   the text path: where each generated message lies in the rendered conversation
    masking.py    the loss mask over the tokens, from those character spans
    converter.py  SampleConverter, to_training_sample: the two paths (engine tokens, re-tokenising)
"""

from buffer.samples.converter import SampleConverter, to_training_sample
from buffer.samples.sample import SampleConversionError, SampleStatus, TrainingSample, sample_status
from buffer.samples.template import ChatTemplateAnalysis, analyse_chat_template

__all__ = [
    "ChatTemplateAnalysis",
    "SampleConversionError",
    "SampleConverter",
    "SampleStatus",
    "TrainingSample",
    "analyse_chat_template",
    "sample_status",
    "to_training_sample",
]
