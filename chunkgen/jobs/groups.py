"""Which rows share a prompt prefix: the one grouping that `--shard` plans with and `--ray` routes by."""

from __future__ import annotations

import hashlib

from chunkgen.jobs.requests import ErrorRecord, Job


def prefix_group_key(item: Job | ErrorRecord) -> str:
    """The template, or the system messages of a chat; a bad line by its line number (so it is
    reported exactly once over all shards and workers)."""
    if isinstance(item, ErrorRecord):
        return f"line:{item.line}"
    if item.template is not None:
        return f"template:{item.template}"
    system = "\x00".join(m["content"] for m in item.messages if m["role"] == "system")
    return f"system:{system}"


def group_digest(item: Job | ErrorRecord) -> bytes:
    """A fixed-size stand-in for the key: a million groups of long system prompts stay small in memory."""
    return hashlib.blake2b(prefix_group_key(item).encode(), digest_size=16).digest()
