"""An image prompt reaches slime's trainer as ``Sample.multimodal_inputs``, with its tokens
masked (slime's real ``Sample`` fields, from tests/support/slime_stub)."""

from __future__ import annotations

import sys

from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from buffer.trainer.samples.turns import samples_from_turns
from buffer.trainer.slime_samples import to_sample

IMAGE = 300
URL = "http://127.0.0.1:8889/images/" + "ab" * 32


def test_an_image_trajectory_becomes_a_slime_sample_with_its_image() -> None:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": URL}}]
    prompt = [1, 11, 1001, 1002, IMAGE, IMAGE, IMAGE, IMAGE, 2, 12]
    trajectory = {
        "uid": "session-s",
        "instance_id": "q",
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "A cat.", "generated": True},
            {"role": "user", "content": [{"type": "text", "text": "And this?"}, content[1]]},
            {"role": "assistant", "content": "The same cat.", "generated": True},
        ],
        "reward": 1.0,
        "extra_info": {},
        "turns": [
            {
                "prompt_ids": prompt,
                "output_ids": [7, 8, 2],
                "output_logprobs": [-0.1, -0.2, -0.3],
                "finish_reason": "stop",
                "message_index": 1,
            },
            {
                "prompt_ids": [*prompt, 7, 8, 2, 11, IMAGE, IMAGE, IMAGE, IMAGE, 2, 12],
                "output_ids": [9, 2],
                "output_logprobs": [-0.4, -0.5],
                "finish_reason": "stop",
                "message_index": 3,
            },
        ],
    }
    (converted,) = samples_from_turns(trajectory, 1.0, 1.0)
    sample = to_sample(trajectory, converted, 0, 0, 1.0)
    assert sample.multimodal_inputs == {"images": [URL, URL]}
    response = sample.tokens[-sample.response_length :]
    assert [mask for token, mask in zip(response, sample.loss_mask, strict=True) if token == IMAGE] == [0] * 4
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1]
