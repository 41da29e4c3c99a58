"""A model folder is data: no code it names runs, no file it links out of itself is read, its
config's sizes are checked against memory and its weights before anything is allocated, and every
tensor the architecture needs comes from the checkpoint with its shape (safetensors and GGUF)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chunkgen.model import ModelNotFound, check_model_dir, load_hf
from chunkgen.model.folder import FolderRefused, check_folder, check_loaded, check_sizes
from tests.cli.test_mistakes import _env
from tests.helpers import base_args

MARKER_CODE = """
import os
open(os.path.join(os.path.dirname(__file__), "MARKER"), "w").write(str(os.getpid()))
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "evil"
"""


def _copy(tiny_model: Path, tmp_path: Path, **config_changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run(folder: Path, tmp_path: Path, stdin: str = "y\ny\n") -> subprocess.CompletedProcess:
    (tmp_path / "q.jsonl").write_text('{"id": "a", "question": "hi"}\n')
    cmd = [sys.executable, "-m", "chunkgen"]
    cmd += base_args(folder, tmp_path / "out.jsonl", tmp_path / "q.jsonl", max_new_tokens=2, dtype=None)
    return subprocess.run(cmd, env=_env(), input=stdin, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "where,changes",
    [
        ("config.json", {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}),
        ("config.json", {"auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}),  # a known type, code named
        ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}),
    ],
    ids=["unknown-type", "known-type", "tokenizer"],
)
def test_an_attackers_folder_runs_no_code_even_when_told_yes(tiny_model, tmp_path, where, changes):
    folder = _copy(tiny_model, tmp_path)
    (folder / "evil.py").write_text(MARKER_CODE)
    data = json.loads((folder / where).read_text())
    data.update(changes)
    (folder / where).write_text(json.dumps(data))
    proc = _run(folder, tmp_path)  # "y" on standard input: nothing may read it
    assert not (folder / "MARKER").exists()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "custom code" in lines[0] and where in lines[0], proc.stderr


def test_an_unknown_model_type_is_refused_by_name(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path, model_type="evil")
    with pytest.raises(FolderRefused, match="model_type 'evil'"):
        check_folder(folder)


def _drop(folder: Path, name: str, rename: str | None = None, reshape: bool = False) -> None:
    tensors = load_file(folder / "model.safetensors")
    value = tensors.pop(name)
    if rename:
        tensors[rename] = value
    if reshape:
        tensors[name] = value[:-1].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda f: _drop(f, "lm_head.weight"), "missing lm_head.weight"),
        (lambda f: _drop(f, "model.layers.1.mlp.up_proj.weight", rename="model.layers.1.mlp.up.weight"), "unexpected"),
        (lambda f: _drop(f, "model.layers.0.self_attn.k_proj.weight", reshape=True), "mis-shaped"),
        (lambda f: _set(f, num_hidden_layers=3), "missing model.layers.2."),
        (lambda f: _set(f, num_hidden_layers=1), "unexpected model.layers.1."),
    ],
    ids=["missing", "renamed", "mis-shaped", "over-layered", "under-layered"],
)
def test_weights_that_do_not_match_the_architecture_are_refused(tiny_model, tmp_path, edit, says):
    folder = _copy(tiny_model, tmp_path)
    edit(folder)
    with pytest.raises(ModelNotFound, match=says) as refused:
        load_hf(folder)
    assert "do not match" in str(refused.value) and "\n" not in str(refused.value)


def _set(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_loading_report_names_the_first_few_tensors():
    info = {"missing_keys": [f"model.layers.{i}.w" for i in range(30)], "unexpected_keys": [], "mismatched_keys": []}
    with pytest.raises(FolderRefused, match=r"missing model\.layers\.0\.w, .* and 27 more"):
        check_loaded("m", info)
    check_loaded("m", {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []})


@pytest.mark.parametrize(
    "changes,says",
    [
        ({"num_hidden_layers": 5000}, "weight files hold"),
        ({"max_position_embeddings": 10**9}, "rotary table"),
        ({"vocab_size": 10**12}, "more than this machine"),
        ({"hidden_size": -4}, "positive integer"),
    ],
    ids=["layers", "positions", "vocabulary", "negative"],
)
def test_absurd_config_sizes_are_refused_before_anything_is_allocated(tiny_model, tmp_path, changes, says):
    folder = _copy(tiny_model, tmp_path, **changes)
    with pytest.raises(ModelNotFound, match=says):
        check_model_dir(folder)


def test_the_default_model_over_layered_is_refused_from_its_headers(default_model_dir, tmp_path):
    """The issue's case: the default model's weights with num_hidden_layers 60."""
    folder = tmp_path / "m"
    folder.mkdir()
    for f in default_model_dir.iterdir():
        (folder / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, folder / f.name)
    _set(folder, num_hidden_layers=60)
    with pytest.raises(FolderRefused, match="num_hidden_layers 60.*the weight files hold"):
        check_folder(folder)


def test_sizes_are_checked_against_the_memory_given():
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "intermediate_size": 11008}
    config.update(vocab_size=32000, max_position_embeddings=4096, model_type="llama")
    check_sizes(Path("config.json"), config, memory=64 << 30)
    with pytest.raises(FolderRefused, match="make weights of at least"):
        check_sizes(Path("config.json"), config, memory=8 << 30)


def test_a_chat_template_linked_from_outside_the_folder_is_refused(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path)
    outside = tmp_path / "secret.txt"
    outside.write_text("the text of another file")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.jinja").symlink_to(outside)
    proc = _run(folder, tmp_path)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "outside the model folder" in lines[0], proc.stderr
    inside = folder / "templates.jinja"
    shutil.copy(tiny_model / "chat_template.jinja", inside)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").symlink_to(inside)  # a link within the folder is the folder's own file
    check_folder(folder)


def test_gguf_conversion_refuses_missing_tensors(tmp_path, monkeypatch):
    """The GGUF's float copy reads transformers' loading report the same way: a converted model
    missing a tensor is refused, never saved with random weights."""
    from transformers import AutoModelForCausalLM

    from chunkgen.model import loading

    def lacking(*args, **kwargs):  # transformers' report of a GGUF without that tensor
        info = {"missing_keys": ["model.layers.0.mlp.up_proj.weight"], "unexpected_keys": [], "mismatched_keys": []}
        return torch.nn.Module(), info

    gguf = loading.default_gguf()
    folder = tmp_path / "models" / "copy"
    folder.mkdir(parents=True)
    loading._note_source(folder, gguf, loading.content_key(gguf))  # the cache folder of that GGUF
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lacking)
    with pytest.raises(ModelNotFound, match="missing model.layers.0.mlp.up_proj.weight"):
        loading.float_weights(folder)
    assert not list(folder.glob("*.safetensors"))


def test_no_transformers_call_may_run_remote_code():
    """Every from_pretrained in the package says trust_remote_code=False (a folder's code never runs)."""
    root = Path(__file__).resolve().parents[2] / "chunkgen"
    for path in root.rglob("*.py"):
        text = path.read_text()
        for i, line in enumerate(text.splitlines()):
            if ".from_pretrained(" in line:
                call = "\n".join(text.splitlines()[i : i + 8])
                assert "trust_remote_code=False" in call, f"{path}:{i + 1}"
