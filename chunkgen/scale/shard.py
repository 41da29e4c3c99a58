"""`--shard i/N`: a deterministic split of a query file by prompt prefix, for SLURM arrays and the
like. Every row of one template (or, for OpenAI batch rows, of one system message) lands in the same
shard, so each shared prefix is prefilled on one worker only."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from chunkgen.jobs.requests import ErrorRecord, Job


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
            raise ValueError(f"--shard takes i/N with 0 <= i < N, e.g. 0/4; got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def owns(self, item: Job | ErrorRecord) -> bool:
        return _bucket(prefix_key(item), self.count) == self.index


def prefix_key(item: Job | ErrorRecord) -> str:
    """What decides the shard: the template, or the system messages of a chat; a bad line by its
    line number (so it is reported exactly once over all shards)."""
    if isinstance(item, ErrorRecord):
        return f"line:{item.line}"
    if item.template is not None:
        return f"template:{item.template}"
    system = "\x00".join(m["content"] for m in item.messages if m["role"] == "system")
    return f"system:{system}"


def _bucket(key: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % n
