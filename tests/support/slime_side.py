"""slime's own training loop driving the adapter, run under slime's runtime (``.slime-venv``, with
slime and the Megatron-LM it pins on ``PYTHONPATH``; ``tests/slime/conftest.py`` starts it).

    python slime_side.py SPEC.json REPORT.json -- <slime's command line>

Nothing of slime is stubbed. slime's ``parse_args`` parses the command line (with the
adapter's ``add_arguments``); slime's ``train.py`` or ``train_async.py`` ``train(args)`` runs
as it is, with its ``RolloutManager`` built by ``create_rollout_manager`` under Ray (its real
``__init__``, ``generate``, ``_convert_samples_to_train_data``, ``_split_train_data_by_dp``,
``log_rollout_data`` and ``eval``). What the machine lacks is swapped for the CPU, at the two
seams where slime places GPUs:

- ``create_placement_groups``: no GPUs to place, so no placement group;
- ``create_training_models``: a Ray actor that trains as slime's ``MegatronTrainRayActor``
  does up to the model: slime's ``process_rollout_data``, ``compute_advantages_and_returns``,
  ``train_metric_utils.log_rollout_data`` and ``loss_function`` (KL, TIS or
  ``--use-rollout-logprobs``) on a world-size-1 gloo group with Megatron's
  ``initialize_model_parallel(1, 1)``, random logits in place of the model's; its
  ``update_weights`` is what slime's weight sync does to an SGLang engine over HTTP
  (``/pause_generation`` in abort mode, ``/update_weights_from_disk`` with the next
  ``weight_version``, ``/continue_generation``), counting the requests it aborts.

The report (JSON) has, per training step, every sample as the trainer received it (tokens,
response length, loss mask, rollout log probs, rewards, truncation) with the loss and the
logged metrics, the evaluations slime logged, and the engine's abort counts at each sync.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import ray
import torch


def _report_path() -> Path:
    return Path(os.environ["SLIME_SIDE_REPORT"])


def _record(kind: str, entry: dict[str, Any]) -> None:
    """Append one line to the report: the trainer actor and the driver both write it."""
    with _report_path().open("a") as report:
        report.write(json.dumps({"kind": kind, **entry}, default=float) + "\n")


class CpuAccelerator:
    """slime's accelerator interface on the CPU (``slime.utils.accelerator.set_accelerator``)."""

    @staticmethod
    def build() -> Any:
        from slime.utils.accelerator.torch_accelerator import TorchAccelerator

        class _Cpu(TorchAccelerator):
            name = "cpu"
            device_type = "cpu"

            def _module(self) -> Any:
                return torch.cpu

            def is_available(self) -> bool:
                return True

            def current_device(self) -> int:
                return 0

            def device_name(self, index: Any = None) -> str:
                return "cpu"

            def communication_backend(self, default: str = "nccl") -> str:
                return "gloo"

        return _Cpu()


@ray.remote(num_cpus=0)
class CpuTrainer:
    """The train side of slime's actor, on the CPU, up to the model (see the module's docstring)."""

    def __init__(self, args: Any, engine_url: str, report: str) -> None:
        os.environ["SLIME_SIDE_REPORT"] = report
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from slime.utils import accelerator

        accelerator.set_accelerator(CpuAccelerator.build())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=0, world_size=1)
        mpu.initialize_model_parallel(1, 1)
        self.args = args
        self.engine_url = engine_url
        self.weight_version = int(getattr(args, "update_weight_start_version", None) or 0)
        self.generator = torch.Generator().manual_seed(0)

    def train(self, rollout_id: int, rollout_data_ref: Any) -> dict[str, Any]:
        from slime.backends.megatron_utils.loss import compute_advantages_and_returns, loss_function
        from slime.observability import train_metric_utils
        from slime.utils.data import process_rollout_data

        args = self.args
        data = process_rollout_data(args, rollout_data_ref, 0, 1)
        lengths = [int(length) for length in data["response_lengths"]]
        # The model's log probs: the sampling ones and a little noise (what a policy one update
        # on would give), the reference the same with other noise.
        base = data.get("rollout_log_probs") or [torch.full((n,), -1.0) for n in lengths]
        data["log_probs"] = [self._near(torch.as_tensor(lp, dtype=torch.float32)) for lp in base]
        if args.use_kl_loss or args.kl_coef != 0:
            data["ref_log_probs"] = [self._near(torch.as_tensor(lp, dtype=torch.float32)) for lp in base]
        compute_advantages_and_returns(args, data)
        train_metric_utils.log_rollout_data(rollout_id, args, data)
        losses = [self._loss(loss_function, data, index) for index in range(len(lengths))]
        samples = [
            {
                "tokens": [int(token) for token in data["tokens"][index]],
                "response_length": lengths[index],
                "loss_mask": [int(value) for value in data["loss_masks"][index]],
                "rollout_log_probs": (
                    [float(value) for value in data["rollout_log_probs"][index]]
                    if "rollout_log_probs" in data
                    else None
                ),
                "multimodal": _shapes((data.get("multimodal_train_inputs") or [None] * len(lengths))[index]),
                "reward": float(data["rewards"][index]),
                "advantage_first": float(data["advantages"][index][0]) if lengths[index] else None,
                "truncated": int(data["truncated"][index]),
            }
            for index in range(len(lengths))
        ]
        raw = data.get("raw_reward")
        _record(
            "train",
            {
                "rollout_id": rollout_id,
                "samples": samples,
                "raw_reward": [float(value) for value in raw] if raw is not None else None,
                "losses": losses,
            },
        )
        return {"samples": len(samples)}

    def _near(self, log_probs: torch.Tensor) -> torch.Tensor:
        return log_probs + 0.01 * torch.randn(log_probs.shape, generator=self.generator)

    def _loss(self, loss_function: Any, data: dict[str, Any], index: int) -> float:
        """slime's ``loss_function`` on one sample as its own micro-batch, with random logits
        over the whole sequence in place of the model's."""
        keys = (
            "tokens", "response_lengths", "loss_masks", "total_lengths", "advantages", "returns",
            "log_probs", "ref_log_probs", "rollout_log_probs", "rollout_mask_sums", "rewards",
        )  # fmt: skip
        batch: dict[str, Any] = {key: [data[key][index]] for key in keys if key in data}
        batch["unconcat_tokens"] = [torch.as_tensor(data["tokens"][index])]
        batch["tokens"] = torch.as_tensor(data["tokens"][index]).unsqueeze(0)
        batch["loss_masks"] = [torch.as_tensor(mask, dtype=torch.float32) for mask in batch["loss_masks"]]
        for key in ("log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns"):
            if key in batch:
                batch[key] = [torch.as_tensor(value, dtype=torch.float32) for value in batch[key]]
        vocab = json.loads((Path(self.args.hf_checkpoint) / "config.json").read_text())["vocab_size"]
        length = int(data["total_lengths"][index])
        logits = torch.randn((1, length, vocab), generator=self.generator, requires_grad=True)
        loss, _, _ = loss_function(self.args, batch, 1, 1, logits)
        loss.backward()
        if not torch.isfinite(loss) or logits.grad is None or not torch.isfinite(logits.grad).all():
            raise AssertionError(f"sample {index}: loss {loss} or its gradient is not finite")
        return float(loss)

    def update_weights(self) -> dict[str, Any]:
        """What slime's weight sync does to an SGLang engine, over HTTP: pause (abort what is in
        flight), load the next weight version, continue."""
        with httpx.Client(base_url=self.engine_url, timeout=60) as engine:
            before = engine.get("/control").json()["aborted"]
            engine.post("/pause_generation", json={"mode": "abort"}).raise_for_status()
            self.weight_version += 1
            engine.post(
                "/update_weights_from_disk",
                json={"model_path": "ckpt", "weight_version": str(self.weight_version)},
            ).raise_for_status()
            aborted = engine.get("/control").json()["aborted"] - before
            engine.post("/continue_generation", json={}).raise_for_status()
        _record("sync", {"weight_version": self.weight_version, "aborted": aborted})
        return {"aborted": aborted}


class ActorModel:
    """What slime's loops call on ``actor_model`` (``RayTrainGroup``), for the CPU trainer."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def async_train(self, rollout_id: int, rollout_data_ref: Any, external_data: Any = None) -> Any:
        return self.trainer.train.remote(rollout_id, rollout_data_ref)

    def update_weights(self) -> None:
        ray.get(self.trainer.update_weights.remote())

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        pass  # nothing to save: the model is random logits

    def clear_memory(self) -> None:
        pass

    def create(self) -> None:
        pass


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``, in every process of the run: what slime logs (its
    ``logging_utils.log``, where wandb and TensorBoard get the metrics) goes to the report too."""
    from slime.observability import logging_utils

    logged = logging_utils.log
    if getattr(logged, "recorded", False):
        return

    def log(args: Any, metrics: dict[str, Any], step_key: str) -> None:
        _record("log", {"metrics": {key: _number(value) for key, value in metrics.items()}})
        logged(args, metrics, step_key)

    log.recorded = True  # type: ignore[attr-defined]
    logging_utils.log = log


def _shapes(inputs: Any) -> dict[str, Any] | None:
    """A sample's ``multimodal_train_inputs`` as the trainer got them: each tensor's shape, and
    the image grids themselves."""
    if inputs is None:
        return None
    shapes: dict[str, Any] = {}
    for key, value in inputs.items():
        tensor = torch.as_tensor(value)
        shapes[key] = tensor.tolist() if key.endswith("grid_thw") else list(tensor.shape)
    return shapes


def prepare_vlm(folder: Path) -> None:
    """A VLM checkpoint and a test's trajectories for it, built here (slime's runtime has the
    image libraries): the simulator's tokenizer with LLaVA's image token, LLaVA's processor (a
    CLIP image processor on PIL, 28-pixel crops in 14-pixel patches: 4 image tokens a picture),
    the test's tiny text config; and ``fixture.jsonl``, groups of two trajectories as a
    generator writes them (token records, raw rewards): one group asking about a picture, whose
    prompt holds the image tokens the processor makes for it, and one with a trajectory the
    converter refuses (no assistant message)."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from buffer.simulator.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    checkpoint = folder / "checkpoint"
    processor.save_pretrained(checkpoint)  # tokenizer and processor; config.json is the test's
    config = json.loads((checkpoint / "config.json").read_text())  # the test's text model
    config["vocab_size"] = len(tokenizer) + 64
    (checkpoint / "config.json").write_text(json.dumps(config))

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    pad = int(processor.image_token_id)
    pads = list(processor(text="<image>", images=[picture])["input_ids"][0]).count(pad)

    def item(instance_id: str, k: int, raw: float, answer: str, picture_url: str | None) -> dict[str, Any]:
        question = "What is in the picture?" if picture_url else "What is 2 + 2?"
        content: Any = question
        prompt = tokenizer.encode(question, add_special_tokens=False)
        if picture_url:
            content = [
                {"type": "text", "text": question},
                {"type": "image_url", "image_url": {"url": picture_url}},
            ]
            prompt = [*[pad] * pads, *prompt]
        output = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        return {
            "prompt": [{"role": "user", "content": content}],  # what slime's data source reads,
            "label": answer,  # as slime's data sets have them
            "instance_id": instance_id,
            "uid": f"{instance_id}-{k}",
            "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
            "reward": raw,
            "extra_info": {
                "prompt_token_ids": prompt,
                "token_ids": output,
                "logprobs": [-0.5] * len(output),
            },
        }

    rows = [
        item("picture", 0, 1.0, "A picture of noise.", url),
        item("picture", 1, 0.0, "A cat.", url),
        item("sum", 0, 1.0, "It is 4.", None),
        item("sum", 1, 0.0, "It is 5.", None),
    ]
    rows[3]["messages"] = rows[3]["messages"][:1]  # nothing to train on: the converter refuses it
    rows[3]["extra_info"] = {}
    (folder / "fixture.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    _record("prepared", {"image_tokens": pads, "image_pad": pad})


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    if sys.argv[1] == "prepare-vlm":  # python slime_side.py prepare-vlm FOLDER REPORT
        os.environ["SLIME_SIDE_REPORT"] = str(Path(sys.argv[3]).resolve())
        prepare_vlm(Path(sys.argv[2]))
        return
    separator = sys.argv.index("--")
    spec = json.loads(Path(sys.argv[1]).read_text())
    report = Path(sys.argv[2]).resolve()
    report.write_text("")
    os.environ["SLIME_SIDE_REPORT"] = str(report)
    sys.argv = [sys.argv[0], *sys.argv[separator + 1 :]]

    from slime.ray import placement_group
    from slime.utils.arguments import parse_args

    from buffer.trainer.slime_rollout import add_arguments

    args = parse_args(add_custom_arguments=add_arguments)
    engine_url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    setup_worker()
    ray.init(
        num_cpus=4,
        num_gpus=0,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": "tests.support.slime_side.setup_worker"},
    )

    def create_placement_groups(args: Any) -> dict[str, Any]:
        return {"actor": None, "critic": None, "rollout": None}

    def create_training_models(args: Any, pgs: Any, rollout_manager: Any, actor_cls: Any = None) -> Any:
        ray.get(
            rollout_manager.set_train_parallel_config.remote(
                {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
            )
        )
        if args.start_rollout_id is None:
            args.start_rollout_id = 0
        return ActorModel(CpuTrainer.remote(args, engine_url, str(report))), None

    loop = __import__(spec["loop"])  # slime's train.py or train_async.py, from slime's root
    loop.create_placement_groups = create_placement_groups
    loop.create_training_models = create_training_models
    placement_group.create_placement_groups = create_placement_groups
    try:
        loop.train(args)
    finally:
        ray.shutdown()
    _record("done", {"num_rollout": args.num_rollout})


if __name__ == "__main__":
    main()
