"""Finding a model: repo ids from the local Hugging Face cache, and the conversion cache keyed on a
GGUF's content rather than its path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkgen.cli import app
from chunkgen.model import ModelNotFound, resolve_model, stale_copies
from chunkgen.model.loading import content_key, default_gguf, display_name
from tests.helpers import PROMPTS, base_args

runner = CliRunner()
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _place_in_hf_cache(model_dir: Path, hf_home: Path, repo: str = REPO, commit: str = "0123abcd") -> Path:
    """The hub cache layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main."""
    entry = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            blob = entry / "blobs" / f.name
            blob.symlink_to(f.resolve())
            (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snapshot


def test_repo_id_resolves_from_the_hf_cache_without_network(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    snapshot = _place_in_hf_cache(tiny_model, tmp_path / "hf", "acme/tiny")
    assert resolve_model("acme/tiny") == snapshot
    assert display_name(snapshot) == "acme/tiny"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE comes before HF_HOME
    with pytest.raises(ModelNotFound, match="elsewhere"):
        resolve_model("acme/tiny")


def test_a_missing_repo_id_names_the_folders_searched(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "hi"}\n')
    res = runner.invoke(app, base_args("acme/absent", tmp_path / "out.jsonl", queries))
    assert res.exit_code == 1
    text = " ".join(res.output.split())
    assert "error: model 'acme/absent' not found" in text
    assert str(tmp_path / "acme" / "absent") in text  # the folder it would be as a path
    assert str(tmp_path / "hf" / "hub" / "models--acme--absent") in text  # and the cache entry
    assert "never downloaded" in text
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.real_model
def test_default_model_by_repo_id_in_a_temporary_hf_home(default_model_dir, tmp_path, monkeypatch):
    """The embedded default model placed in an HF cache answers exactly as the default does."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _place_in_hf_cache(default_model_dir, tmp_path / "hf")
    template = tmp_path / "short.toml"
    template.write_text('system = "You are a helpful assistant."\nuser = "{question}"\n')
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"id": "q", "question": "What is the capital of France?"}) + "\n")
    texts = {}
    for name, model in (("repo", REPO), ("default", None)):
        out = tmp_path / f"{name}.jsonl"
        res = runner.invoke(app, base_args(model, out, queries, template, max_new_tokens=6))
        assert res.exit_code == 0, res.output
        texts[name] = [r["text"] for r in map(json.loads, out.read_text().splitlines())]
    assert texts["repo"] == texts["default"] and texts["repo"][0]


@pytest.mark.real_model
def test_conversion_cache_is_keyed_on_content_not_path(default_model_dir, tmp_path):
    """A copy of the default GGUF elsewhere (another environment's install) finds the copy made."""
    gguf = default_gguf()
    moved = tmp_path / "other-env" / gguf.name
    moved.parent.mkdir()
    shutil.copyfile(gguf, moved)
    assert content_key(moved) == content_key(gguf)
    converted = []
    assert resolve_model(moved, on_convert=lambda *a: converted.append(a)) == default_model_dir
    assert converted == []
    with open(moved, "r+b") as f:  # a changed header is another model
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert content_key(moved) != content_key(gguf)


def test_a_gguf_folder_follows_its_file_when_it_moves(tmp_path, monkeypatch):
    """The cache folder of a GGUF names the file its weights are read from: when that file is gone
    (its environment removed) and the same content is found elsewhere, the folder names that one."""
    from chunkgen.model.loading import SOURCE_FILE, _note_source, gguf_of

    gguf = default_gguf()
    monkeypatch.setenv("CHUNKGEN_CACHE", str(tmp_path))
    folder = tmp_path / "models" / f"{gguf.stem}-{content_key(gguf)}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # made before; only the note matters here
    gone = tmp_path / "old-env" / gguf.name
    gone.parent.mkdir()
    shutil.copyfile(gguf, gone)
    _note_source(folder, gone, content_key(gguf))
    gone.unlink()
    assert gguf_of(folder) is None
    assert resolve_model(gguf) == folder
    assert gguf_of(folder) == gguf.resolve()
    assert json.loads((folder / SOURCE_FILE).read_text())["gguf"] == str(gguf.resolve())


def test_a_gguf_folder_without_its_file_is_refused_by_name(tmp_path):
    """A cache folder whose GGUF is gone or changed holds no weights: the load says so, naming it."""
    from chunkgen.model import check_model_dir
    from chunkgen.model.loading import SOURCE_FILE

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / SOURCE_FILE).write_text(json.dumps({"gguf": "/nowhere/m.gguf", "size": 1, "key": "abc"}))
    with pytest.raises(ModelNotFound, match=r"the GGUF file this folder was made from \(/nowhere/m.gguf\) is gone"):
        check_model_dir(tmp_path)


def test_stale_copies_are_other_keys_of_the_same_file_name(tmp_path):
    models = tmp_path / "models"
    for name in ("M.Q4-aaaaaaaaaaaa", "M.Q4-bbbbbbbbbbbb", "M.Q4-extra-cccccccccccc", "Other-dddddddddddd"):
        (models / name).mkdir(parents=True)
    assert stale_copies(models / "M.Q4-aaaaaaaaaaaa") == [models / "M.Q4-bbbbbbbbbbbb"]


# -- tokenizers as transformers releases save them -------------------------------------------------
# The decoder chain transformers 5.17 writes for a GGUF's byte-level (gpt2) tokenizer.
MIXED_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}


def _byte_level_bpe(out: Path) -> Path:
    """A small byte-level BPE (the gpt2 / SmolLM2 / Llama 3 kind) trained on the shipped prompts,
    saved with the mixed decoder chain above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([f.read_text() for f in sorted(PROMPTS.glob("*.toml"))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(out)
    state = json.loads((out / "tokenizer.json").read_text())
    state["decoder"] = MIXED_DECODER
    (out / "tokenizer.json").write_text(json.dumps(state))
    return out


def test_a_byte_level_tokenizer_gets_the_byte_level_decoder_llguidance_reads(tmp_path):
    """Loaded as AutoTokenizer gives it, llguidance takes the mixed chain for a sentencepiece
    vocabulary and refuses a valid JSON answer at its first token that starts with a space;
    load_tokenizer gives the plain ByteLevel decoder, the same text, and the answer is accepted."""
    import llguidance
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    from chunkgen.engine.params import compile_spec
    from chunkgen.model.loading import load_tokenizer

    path = _byte_level_bpe(tmp_path / "tok")
    raw, fixed = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    assert json.loads(fixed.backend_tokenizer.decoder.__getstate__())["type"] == "ByteLevel"
    answer = '{"function": "get_weather", "arguments": {"location": "Oslo"}}'
    ids = fixed.encode(answer, add_special_tokens=False)
    assert raw.encode(answer, add_special_tokens=False) == ids and fixed.decode(ids) == raw.decode(ids) == answer
    assert any(fixed.convert_ids_to_tokens(i).startswith("Ġ") for i in ids)
    grammar = compile_spec("json_schema", json.dumps({"type": "object"}))

    def accepted(tokenizer) -> bool:
        matcher = llguidance.LLMatcher(from_tokenizer(tokenizer, n_vocab=len(tokenizer)), grammar, log_level=0)
        return matcher.consume_tokens(ids) and not matcher.is_error()

    assert not accepted(raw)
    assert accepted(fixed)


def test_conversion_takes_what_the_gguf_says_of_its_tokenizer(default_model_dir):
    """transformers 5.17 saves the default model's tokenizer with <|im_start|> as its EOS, 4.57 and
    5.17 with spaces cleaned up in decoded text; the conversion sets each special token from the
    file's own tokenizer.ggml.*_token_id, whether BOS is added from tokenizer.ggml.add_bos_token,
    and no clean-up."""
    from chunkgen.model.loading import _tokenizer_facts_of, load_tokenizer

    tok = load_tokenizer(default_model_dir)
    tok.eos_token, tok.clean_up_tokenization_spaces = "<|im_start|>", True
    _tokenizer_facts_of(default_gguf(), tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert not tok.clean_up_tokenization_spaces
    assert tok.decode(tok.encode("'quote' n't", add_special_tokens=False)) == "'quote' n't"
    assert tok.encode("hi")[0] != tok.bos_token_id  # the GGUF adds no BOS
