"""Speculative decoding: proposers behind one small interface, and the acceptance statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from lmserve.sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens for one sequence, and the distributions they were drawn from (None: point mass)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V)


class Proposer(Protocol):
    """Proposes up to k tokens to follow each sequence's committed tokens."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]: ...

    def release(self, seq: Sequence) -> None:
        """Forget any state kept for a finished sequence."""
        ...


@dataclass
class SpecStats:
    """Cumulative speculation counters."""

    num_verifications: int = 0  # sequence-steps that verified at least one draft
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    proposed_at: list[int] = field(default_factory=list)  # per draft position: times proposed

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_verifications += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        while len(self.proposed_at) < num_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the corrected or bonus token)."""
        return 1 + self.accepted / self.num_verifications if self.num_verifications else 0.0

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "acceptance_by_position": self.acceptance_by_position, "verifications": self.num_verifications,
                "mean_accepted_length": self.mean_accepted_length,
                "proposed_at": list(self.proposed_at), "accepted_at": list(self.accepted_at)}
