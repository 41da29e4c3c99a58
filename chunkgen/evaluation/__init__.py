"""lm-evaluation-harness on chunkgen: the `chunkgen` model backend (lm_eval_backend.py) and the
`chunkgen eval` command that runs lm_eval with it registered."""
