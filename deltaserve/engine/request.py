"""One generation request as the scheduler tracks it: its tokens, its progress, its state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted): holds no slot and no KV
    RUNNING = "running"  # holds a slot; scheduled every step the budget allows
    PARKED = "parked"  # holds its slot but is never scheduled nor preempted
    FINISHED = "finished"  # done or aborted; holds nothing


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """A prompt's images as the language model sees them: the prompt positions of the image
    placeholder tokens (ascending), the embeddings those positions take, and the prompt ids with
    each placeholder replaced by a key of its image's content (negative, so never a real token):
    the prefix cache hashes key_ids, so two prompts share a snapshot only if their images match."""

    positions: tuple[int, ...]
    embeds: torch.Tensor  # [len(positions), N] in the model's activation dtype, on its device
    key_ids: tuple[int, ...]  # len(prompt_ids)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int  # the scheduler never schedules past prompt+max_new_tokens
    arrival: int = 0  # set by Scheduler.add (monotonic counter): FCFS order
    output_ids: list[int] = field(default_factory=list)  # the tokens read back, in order
    # tokens sampled on the device and not read back yet (engine/overlap.py): they take the
    # positions after output_ids
    num_unread: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens of all_ids whose effect is in the cache slot
    num_restored: int = 0  # of those, how many came from the prefix cache at admission (metrics)
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" once FINISHED
    images: ImageInputs | None = None
    # every prompt position computed, none restored from the prefix cache (prompt logprobs)
    full_prefill: bool = False

    @property
    def key_ids(self) -> list[int]:
        """The ids the prefix cache keys on: all_ids, image placeholders keyed by content."""
        if self.images is None:
            return self.all_ids
        return list(self.images.key_ids) + self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_known(self) -> int:
        """len(all_ids) without building the list: the tokens whose ids the host has."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Every position the request has, the unread ones too (the scheduler asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_unread

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """all_ids[start:end] without copying the whole prompt (a decode reads one token); known
        positions only (end <= num_known)."""
        n = len(self.prompt_ids)
        if end <= n:
            return tuple(self.prompt_ids[start:end])
        if start >= n:
            return tuple(self.output_ids[start - n : end - n])
        return tuple(self.prompt_ids[start:]) + tuple(self.output_ids[: end - n])
