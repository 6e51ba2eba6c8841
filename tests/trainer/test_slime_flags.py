"""slime's flags and the adapter (issue 21, items 6 and 8): the adapter's own settings on slime's
command line, and each of slime's rollout flags honoured in the ``/start_rollout`` payload or
refused up front with the reason, never ignored."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import slime_runtime
from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from buffer.toolkit.dataset import DatasetError, read_rows
from buffer.toolkit.runner import RolloutSettings
from buffer.trainer import slime_rollout

COMMAND_LINE = [
    "--rollout-buffer-url", "http://127.0.0.1:8889",
    "--rollout-buffer-pause", "abort",
    "--rollout-buffer-max-staleness", "2",
    "--rollout-num-process", "32",
]  # fmt: skip


def _args(**overrides: Any) -> SimpleNamespace:
    """slime's parsed arguments, at slime's defaults for the flags under test."""
    values: dict[str, Any] = {
        "rollout_buffer_url": "http://buffer",
        "rollout_task_type": "math",
        "prompt_data": "/data/train.jsonl",
        "n_samples_per_prompt": 4,
        "rollout_batch_size": 2,
        "rollout_max_response_len": 64,
        "rollout_temperature": 1.0,
        "rollout_top_p": 1.0,
        "rollout_top_k": -1,
        "num_epoch": 1,
        "sglang_router_ip": "127.0.0.1",
        "sglang_router_port": 30000,
        "hf_checkpoint": "/models/qwen",
        "input_key": "input",
        "label_key": None,
        "metadata_key": "metadata",
        "tool_key": "tools",
        "rollout_seed": 42,
        "rollout_shuffle": False,
        "rollout_stop_token_ids": None,
        "rollout_max_prompt_len": None,
        "rollout_max_context_len": None,
        "partial_rollout": False,
        "mask_offpolicy_in_partial_rollout": False,
        "over_sampling_batch_size": 2,
        "dynamic_sampling_filter_path": None,
        "rollout_sample_filter_path": None,
        "rollout_all_samples_process_path": None,
        "custom_generate_function_path": None,
        "rm_type": None,
        "custom_rm_path": None,
        "group_rm": False,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


# --- item 8: the adapter's settings on slime's command line ---------------------------------


def _megatron_like_parser(add_custom_arguments: Any = None) -> argparse.ArgumentParser:
    """slime's parse in miniature: Megatron's parser, the custom hook first, slime's own rollout
    buffer flags after it, and ``parse_known_args`` (slime's ``megatron_parse_args`` passes
    ``ignore_unknown_args=True``), which drops every flag nobody registered."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser)
    parser.add_argument("--rollout-buffer-url", type=str, default=None)
    parser.add_argument("--rollout-task-type", type=str, default="math")
    return parser


def test_without_the_hook_slime_drops_the_adapters_flags() -> None:
    args, unknown = _megatron_like_parser().parse_known_args(COMMAND_LINE)
    assert not hasattr(args, "rollout_buffer_pause")
    assert "--rollout-buffer-pause" in unknown


def test_the_hook_registers_the_adapters_flags() -> None:
    args, unknown = _megatron_like_parser(slime_rollout.add_arguments).parse_known_args(COMMAND_LINE)
    assert unknown == []
    assert args.rollout_buffer_pause == "abort"
    assert args.rollout_buffer_max_staleness == 2
    assert args.rollout_num_process == 32
    assert args.rollout_buffer_api_key is None
    payload = slime_rollout._train_payload(_args(**vars(args)))
    assert payload["num_process"] == "32"
    assert payload["max_staleness"] == 2
    assert payload["rollout_batch_size"] == 2  # slime's batch, in groups: admission's size


def test_the_hook_is_at_the_old_import_path() -> None:
    import buffer.slime_rollout

    assert buffer.slime_rollout.add_arguments is slime_rollout.add_arguments


def test_the_hook_refuses_a_pause_mode_the_buffer_does_not_know() -> None:
    with pytest.raises(SystemExit):
        _megatron_like_parser(slime_rollout.add_arguments).parse_known_args(
            ["--rollout-buffer-pause", "stop"]
        )


PARSE = """
import sys
from slime.utils.arguments import parse_args
from buffer.slime_rollout import add_arguments
args = parse_args(add_custom_arguments=add_arguments)
print(args.rollout_buffer_pause, args.rollout_buffer_max_staleness, args.rollout_num_process)
"""


def test_slimes_own_parse_args_takes_the_adapters_flags(tmp_path: Path) -> None:
    python, folder = slime_runtime.require()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    argv = [
        "--debug-rollout-only",
        "--rollout-num-gpus", "0",
        "--rollout-function-path", "buffer.slime_rollout.generate_rollout",
        "--prompt-data", str(data),
        "--input-key", "prompt",
        "--label-key", "label",
        "--num-rollout", "2",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--global-batch-size", "8",
        *COMMAND_LINE,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": slime_runtime.pythonpath(folder), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(python), "-c", PARSE, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "abort 2 32"


def test_slime_registers_none_of_the_adapters_flags() -> None:
    """``add_custom_arguments`` runs before slime adds its own: a flag of the same name would make
    slime's parser fail on the conflict."""
    folder = slime_runtime.third_party()
    if folder is None:
        pytest.skip("slime's code is not in ../shared/third_party (or ROLLOUT_BUFFER_THIRD_PARTY)")
    source = folder / slime_runtime.SLIME / "slime" / "utils" / "arguments.py"
    text = source.read_text()
    parser = slime_rollout.add_arguments(argparse.ArgumentParser())
    ours = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--r")]
    assert len(ours) == 5
    assert [flag for flag in ours if f'"{flag}"' in text] == []


# --- item 6: slime's rollout flags honoured or refused -------------------------------------


def test_the_data_set_flags_reach_the_payload() -> None:
    args = _args(
        input_key="question",
        label_key="answer",
        rollout_seed=7,
        rollout_shuffle=True,
        rollout_stop_token_ids=[151643, 151645],
    )
    payload = slime_rollout._train_payload(args)
    settings = RolloutSettings.model_validate(payload)
    assert (settings.input_key, settings.label_key) == ("question", "answer")
    assert (settings.seed, settings.shuffle) == (7, True)
    assert settings.sampling_params["stop_token_ids"] == [151643, 151645]


def test_slimes_defaults_do_not_shuffle_and_seed_42() -> None:
    settings = RolloutSettings.model_validate(slime_rollout._train_payload(_args()))
    assert (settings.seed, settings.shuffle) == (42, False)
    assert (settings.input_key, settings.label_key) == ("input", "label")
    assert "stop_token_ids" not in settings.sampling_params


def test_rows_are_read_by_slimes_keys(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "label": "4"}\n')
    rows = read_rows(data, input_key="question", label_key="answer")
    assert [(row["prompt"], row["label"]) for row in rows] == [("1+1?", "2"), ("2+2?", "4")]
    with pytest.raises(DatasetError, match="its prompt in 'input'"):
        read_rows(_written(tmp_path, '{"question": "1+1?"}\n'), input_key="input")


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "other.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("partial_rollout", True, "--partial-rollout"),
        ("over_sampling_batch_size", 4, "--over-sampling-batch-size"),
        ("dynamic_sampling_filter_path", "mod.keep", "--dynamic-sampling-filter-path"),
        ("rollout_sample_filter_path", "mod.keep", "--rollout-sample-filter-path"),
        ("rollout_all_samples_process_path", "mod.f", "--rollout-all-samples-process-path"),
        ("custom_generate_function_path", "mod.gen", "--custom-generate-function-path"),
        ("rm_type", "deepscaler", "--rm-type"),
        ("custom_rm_path", "mod.rm", "--custom-rm-path"),
        ("group_rm", True, "--group-rm"),
        ("metadata_key", "meta", "--metadata-key"),
        ("tool_key", "functions", "--tool-key"),
        ("rollout_max_prompt_len", 512, "--rollout-max-prompt-len"),
        ("eval_input_key", "q", "--eval-input-key"),
    ],
)
def test_a_flag_the_adapter_cannot_honour_is_refused_up_front(flag: str, value: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        slime_rollout.check_args(_args(**{flag: value}))


def test_masking_off_policy_tokens_is_honoured() -> None:
    slime_rollout.check_args(_args(mask_offpolicy_in_partial_rollout=True))  # per-token versions: issue 24


def test_slimes_defaults_are_accepted() -> None:
    slime_rollout.check_args(_args())
    # slime derives the prompt limit from the context length: not the user's choice, not refused
    slime_rollout.check_args(_args(rollout_max_context_len=4096, rollout_max_prompt_len=4095))


def test_an_eval_data_set_with_other_keys_is_refused() -> None:
    config = SimpleNamespace(name="aime", input_key="problem", label_key=None)
    with pytest.raises(ValueError, match="'aime': input_key 'problem'"):
        slime_rollout.check_args(_args(eval_datasets=[config]))
    slime_rollout.check_args(_args(eval_datasets=[SimpleNamespace(name="aime", input_key="input")]))
