"""slime's rollout function with images, placeholders in slime's metrics, and evaluations
(issue 21, items 7 and 10), through the stand-in of slime in tests/support/slime_stub.

Each test fails without its fix: images reach slime's trainer only as
``multimodal_train_inputs``; a refused trajectory's placeholder does not log as an empty answer;
eval data sets run at once and leave nothing behind; a branched eval trajectory is one sample.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from slime.observability.rollout_metrics import log_eval_rollout_data, log_rollout_data
from slime.ray.rollout import generate
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils import processing_utils

from buffer.trainer import slime_rollout, slime_samples
from tests.trainer import test_slime_adapter as adapter
from tests.trainer.test_slime_adapter import FakeBuffer, branched, eval_items, refused, step, trajectory

# The adapter tests' fixtures: slime's flags, the fake buffer's installer and the tokenizer.
args = adapter.args
connect = adapter.connect
tokenizer = adapter.tokenizer

IMAGE_TOKEN_ID = 99
PNG = b"\x89PNG pretend pixels"


class FakeProcessor:
    """A VLM's processor as slime calls it: images in, their pixels and grids out, and the text
    with each image token expanded to two (the grid's merged patches)."""

    image_token = "<img>"
    image_token_id = IMAGE_TOKEN_ID

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, text: str, images: list[Any], **kwargs: Any) -> dict[str, Any]:
        self.calls.append({"text": text, "images": images, **kwargs})
        assert text.count(self.image_token) == len(images)
        return {
            "input_ids": [[IMAGE_TOKEN_ID, IMAGE_TOKEN_ID] * len(images)],
            "attention_mask": [[1, 1] * len(images)],
            "pixel_values": [f"pixels of {image!r}" for image in images],
            "image_grid_thw": [[1, 2, 2]] * len(images),
        }


def with_image(item: dict[str, Any], image_tokens: int = 2) -> dict[str, Any]:
    """``item`` asking about an image (a ``data:`` URL), the engine's prompt holding its tokens."""
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    item["messages"][0]["content"] = [
        {"type": "text", "text": item["messages"][0]["content"]},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    item["extra_info"]["prompt_token_ids"] = [5, *[IMAGE_TOKEN_ID] * image_tokens, 6, 7, 8]
    return item


@pytest.fixture
def processor(monkeypatch: pytest.MonkeyPatch) -> FakeProcessor:
    """A checkpoint with a processor; images decoded as bytes (PIL stands in for them in slime)."""
    fake = FakeProcessor()
    loaded: list[str] = []
    monkeypatch.setattr(processing_utils, "load_processor", lambda path, **kw: loaded.append(path) or fake)
    monkeypatch.setattr(
        slime_samples, "load_image", lambda *url: slime_samples.image_bytes(*url), raising=False
    )
    fake.loaded = loaded  # type: ignore[attr-defined]
    return fake


def test_images_reach_slimes_trainer_as_the_processors_train_inputs(
    args: SimpleNamespace, connect: Any, processor: FakeProcessor
) -> None:
    """Issue 21, item 7: slime forwards ``multimodal_train_inputs`` alone; without them a VLM
    trains image tokens with no pixels."""
    args.rollout_batch_size = 1
    a0 = with_image(trajectory("a", 0, -0.5, log_probs=True, raw_reward=0))
    a1 = with_image(trajectory("a", 1, 0.5, log_probs=True, raw_reward=1))
    connect(FakeBuffer({"math": [[[a0, a1]]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    expected = {"pixel_values": [f"pixels of {PNG!r}"], "image_grid_thw": [[1, 2, 2]]}
    assert train_data["multimodal_train_inputs"] == [expected, expected]
    assert samples[0].multimodal_inputs == {"images": [a0["messages"][0]["content"][1]["image_url"]["url"]]}
    (call, _) = processor.calls
    assert call["images"] == [PNG]  # the trajectory's image, as the engine got it
    assert call["text_kwargs"] == {
        "return_tensors": None,
        "return_mm_token_type_ids": False,
    }  # slime's kwargs
    assert processor.loaded == [args.hf_checkpoint]  # type: ignore[attr-defined]


def test_a_refused_sibling_of_an_image_sample_holds_its_pixels_and_a_mismatch_is_refused(
    args: SimpleNamespace, connect: Any, processor: FakeProcessor
) -> None:
    """A placeholder holds a sibling's tokens, image tokens included: without the sibling's
    pixels the batch's image tokens outnumber its pixels. A sample whose image tokens are not
    what the trainer's processor makes is refused, with the counts."""
    args.rollout_batch_size = 1
    args.n_samples_per_prompt = 3
    good = with_image(trajectory("a", 0, 0.0, log_probs=True))
    mismatched = with_image(trajectory("a", 1, 0.0, log_probs=True), image_tokens=3)
    connect(FakeBuffer({"math": [[[good, mismatched, refused("a", 2, 0.0)]]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert [s.remove_sample for s in samples] == [False, True, True]
    assert (
        "makes 2 image tokens of the sample's 1 images, and its tokens hold 3"
        in samples[1].metadata["refused"]
    )
    assert samples[2].tokens == samples[0].tokens
    assert train_data["multimodal_train_inputs"] == [train_data["multimodal_train_inputs"][0]] * 3


def test_a_text_only_checkpoint_changes_nothing(args: SimpleNamespace, connect: Any) -> None:
    """No processor (slime's load_processor gives None for a text-only model): no train inputs."""
    args.rollout_batch_size = 1
    items = [with_image(trajectory("a", k, 0.0, log_probs=True)) for k in range(2)]
    connect(FakeBuffer({"math": [[items]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert "multimodal_train_inputs" not in train_data
    assert not any(s.remove_sample for s in samples)


def answer_of(item: dict[str, Any], length: int) -> dict[str, Any]:
    item["extra_info"]["token_ids"] = list(range(20, 20 + length))
    item["extra_info"]["logprobs"] = [-0.5] * length
    return item


def test_a_placeholder_does_not_log_as_an_empty_answer(args: SimpleNamespace, connect: Any) -> None:
    """Issue 21, item 10a: slime logs response_len over every sample, before it builds the
    train data; a placeholder counts as a typical sibling (the median), and trains nothing."""
    args.rollout_batch_size = 1
    args.n_samples_per_prompt = 4
    lengths = [2, 6, 4]
    items = [answer_of(trajectory("a", k, 0.0, log_probs=True), n) for k, n in enumerate(lengths)]
    connect(FakeBuffer({"math": [[[*items, refused("a", 3, 0.0)]]]}))
    source = RolloutDataSourceWithBuffer(args)
    output = slime_rollout.generate_rollout(args, 0, source)
    logged = log_rollout_data(0, args, [s for g in output.samples for s in g], output.metrics, 1.0)
    assert logged["rollout/response_len/min"] == 2
    assert logged["rollout/response_len/median"] == 4
    assert logged["rollout/response_len/mean"] == pytest.approx((2 + 6 + 4 + 4) / 4)
    samples, train_data = generate(args, lambda *a, **k: output, 0, source)
    assert samples[3].remove_sample
    assert train_data["loss_masks"][3] == (0,) * samples[3].response_length


def test_a_refused_eval_trajectory_does_not_log_as_an_empty_answer(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["arith", str(path)]
    group = [answer_of(trajectory("e", 0, 1.0, log_probs=True), 3), refused("e", 1, 0.0)]
    connect(FakeBuffer({"eval-arith": [[group]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    logged = log_eval_rollout_data(0, args, output.data, output.metrics)
    assert logged["eval/arith/response_len/min"] == 3
    assert logged["eval/arith"] == 0.5  # its reward still counts
    assert "no assistant message" in output.data["arith"]["samples"][1].metadata["refused"]


class RecordingBuffer(FakeBuffer):
    """A fake buffer that records the order of starts and reads."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.calls: list[tuple[str, str]] = []

    def start_rollout(self, task_type: str, *, restart: bool = False, **payload: Any) -> None:
        self.calls.append(("start", payload["rollout_name"]))
        super().start_rollout(task_type, restart=restart, **payload)

    def get_rollout_data(
        self, batch_size: int | None = None, task_type: str | None = None, wait_s: float = 0.0
    ) -> Any:
        batch = super().get_rollout_data(batch_size, task_type, wait_s)
        self.calls.append(("read", task_type or ""))
        return batch


def test_eval_data_sets_run_at_once(args: SimpleNamespace, connect: Any, tmp_path: Path) -> None:
    """Issue 21, item 10b: every data set's job starts before any is collected."""
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["arith", str(path), "logic", str(path)]
    buffer = connect(
        RecordingBuffer(
            {"eval-arith": [[eval_items("a", [[1, 0]])[0]]], "eval-logic": [[eval_items("l", [[1, 1]])[0]]]}
        )
    )
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    first_read = next(i for i, call in enumerate(buffer.calls) if call[0] == "read")
    starts = [i for i, call in enumerate(buffer.calls) if call[0] == "start"]
    assert len(starts) == 2
    assert max(starts) < first_read
    assert output.data["arith"]["rewards"] == [1, 0]
    assert output.data["logic"]["rewards"] == [1, 1]


def test_an_evaluation_leaves_no_pending_group_behind(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    """Issue 21, item 10c: a group still open when the job ends is waited for and counted, not left
    to turn ready after the evaluation (and be thrown away by the next one)."""
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n{"q": 2}\n')
    args.eval_prompt_data = ["arith", str(path)]
    first, late = eval_items("e", [[1, 0], [1, 1]])
    buffer = connect(FakeBuffer({"eval-arith": [[first]]}))
    buffer.late = {"eval-arith": [late]}
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    assert output.data["arith"]["rewards"] == [1, 0, 1, 1]
    assert not buffer.queues["eval-arith"]
    assert not buffer.late["eval-arith"]
    assert [job.status for job in buffer.job_list] == ["succeeded"]


def test_an_evaluation_past_its_time_cancels_its_job(connect: Any) -> None:
    """Issue 21, item 10c: the job of an evaluation that gave up waiting is not left running."""
    buffer = connect(FakeBuffer({"eval-arith": [[eval_items("e", [[1, 0]])[0]] * 3]}))
    buffer.start_rollout("math", rollout_name="eval-arith")
    session = slime_rollout._Session(buffer, None, None)  # type: ignore[arg-type]
    assert slime_rollout._collect(session, "eval-arith", 2, 2, timeout_s=0.0) == []
    assert [job.status for job in buffer.job_list] == ["cancelled"]


def test_a_branched_eval_trajectory_is_one_sample_with_its_reward(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    """Issue 21, item 10d: one sample per trajectory, whatever branched, its reward counted once."""
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["arith", str(path)]
    group = eval_items("e", [[0, 1]])[0]
    group[1] = branched(group[1])
    connect(FakeBuffer({"eval-arith": [[group]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    result = output.data["arith"]
    assert result["rewards"] == [0, 1]
    assert [s.reward for s in result["samples"]] == [0, 1]
    assert [s.metadata["uid"] for s in result["samples"]] == ["e0-0", "e0-1"]
    assert result["samples"][1].tokens == [5, 6, 7, 8, 11]  # every branch's response
    assert log_eval_rollout_data(0, args, output.data, output.metrics)["eval/arith-pass@1"] == 0.5
