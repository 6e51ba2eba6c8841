"""The buffer part of slime's ``RolloutDataSourceWithBuffer`` (slime/rollout/data_source.py).

``get_samples`` takes groups from the buffer first and makes up any shortfall with fresh,
ungenerated samples from the prompt data set (here: empty PENDING samples, as slime does
when it has no data set); ``add_samples`` insists on groups of exactly
``n_samples_per_prompt``.
"""

from __future__ import annotations

from typing import Any

from slime.utils.types import Sample


class RolloutDataSourceWithBuffer:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.buffer: list[list[Any]] = []
        self.metadata: dict[str, Any] = {}
        self.sample_group_index = 0
        self.sample_index = 0

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        taken = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        for _ in range(num_samples - len(taken)):  # the prompt data set's fresh samples
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                group.append(Sample(group_index=self.sample_group_index, index=self.sample_index))
                self.sample_index += 1
            self.sample_group_index += 1
            taken.append(group)
        return taken

    def add_samples(self, samples: list[list[Any]]) -> None:
        if not samples:
            return
        assert isinstance(samples[0], list), f"groups must be lists, got {type(samples[0])}"
        for group in samples:
            assert len(group) == self.args.n_samples_per_prompt, (
                f"groups hold n_samples_per_prompt entries: {len(group)} != {self.args.n_samples_per_prompt}"
            )
            self.buffer.append(group)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)
