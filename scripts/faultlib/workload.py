"""The seeded workload: a pool of prompts, the parameters each operation may use, and the mix of
operations a client draws from. Clients and the reference run read the same pool, so an answer is
compared with the greedy output of exactly the prompt and parameters that were sent."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

WORDS = ("river", "stone", "amber", "quiet", "north", "lantern", "copper", "meadow", "signal", "harbor",
         "winter", "orbit", "velvet", "cedar", "echo", "marble", "thunder", "garden", "silver", "compass")
MAX_NEW_TOKENS = (4, 8, 16)
# what a sync or async client does, with weights: plain generate, submit + result under its own job id
# (retried under the same id when the enqueue's fate is unknown), cancel mid-flight, reuse an id whose
# answer was already taken (must be refused), an id other client processes use too (one job per inbox),
# and two concurrent submits of one id with different prompts (the second must not get the first's answer)
CLIENT_OPS = {"generate": 4, "submit": 5, "cancel": 2, "reuse": 1, "shared": 2, "join": 1}


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    timeout_s: float  # every call's timeout (and its job's deadline)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt index, max_new_tokens) for one request."""
        return rng.randrange(len(self.prompts)), rng.choice(MAX_NEW_TOKENS)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(path.read_text()))


def make_workload(seed: int, size: int, timeout_s: float) -> Workload:
    """``size`` distinct short prompts from ``seed`` (few enough that the reference run stays short)."""
    rng = random.Random(f"prompts-{seed}")
    prompts: set[str] = set()
    while len(prompts) < size:
        prompts.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))))
    return Workload(sorted(prompts), timeout_s)
