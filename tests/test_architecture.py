"""The engine package's shape: layers as folders that import only downwards, a light SDK, short files,
and an in-process engine that leaves the libraries it uses as it found them."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"
# each layer may import the layers after it in this list, never the ones before it
LAYERS = ["server", "runtime", "sampling", "sdk"]


def _module_imports() -> dict[str, set[str]]:
    """Module -> the sess.engine modules it imports at module level (not inside functions)."""
    graph = {}
    for path in ENGINE.rglob("*.py"):
        name = "sess.engine." + ".".join(path.relative_to(ENGINE).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        imports = set()
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # annotations only
            for child in ast.walk(node):
                if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("sess.engine"):
                    imports.add(child.module)
                    imports.update(f"{child.module}.{alias.name}" for alias in child.names)
                elif isinstance(child, ast.Import):
                    imports.update(a.name for a in child.names if a.name.startswith("sess.engine"))
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    break
        graph[name] = imports
    modules = set(graph)
    return {m: {i for i in deps if i in modules and i != m} for m, deps in graph.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in LAYERS else None


def test_the_engine_is_layers_as_folders_importing_only_downwards():
    graph = _module_imports()
    assert {p.name for p in ENGINE.iterdir() if p.is_dir() and not p.name.startswith("_")} == set(LAYERS)
    upward = [
        (module, dep)
        for module, deps in graph.items()
        for dep in deps
        if _layer(module) and _layer(dep) and LAYERS.index(_layer(dep)) < LAYERS.index(_layer(module))
    ]
    assert upward == []


def test_no_import_cycles():
    graph = _module_imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*path, module, dep])}")
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_engine_files_read_in_one_sitting():
    long = {
        str(p.relative_to(ENGINE)): n
        for p in ENGINE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 420
    }
    assert long == {}


def test_importing_the_sdk_loads_no_torch_transformers_or_peft():
    code = (
        "import sys, sess.engine\n"
        "from sess.engine import ServiceClient, TrainingClient, SamplingClient, Datum, TensorData\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


SNAPSHOT = textwrap.dedent(
    """
    import json, sys, warnings

    def snapshot():
        import peft.tuners.lora.layer as lora
        import torch
        import transformers
        from transformers import modeling_utils, masking_utils
        from transformers.utils import logging as hf_logging
        from transformers.models.llama import modeling_llama

        classes = [lora.Linear, lora.LoraLayer, torch.nn.Linear, torch.nn.Module, modeling_llama.LlamaAttention,
                   modeling_llama.LlamaForCausalLM, modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaMLP]
        return {
            "classes": {c.__qualname__: sorted((k, id(v)) for k, v in vars(c).items()) for c in classes},
            "functions": [id(torch.nn.functional.linear), id(torch.nn.functional.scaled_dot_product_attention)],
            "attention": sorted(modeling_utils.ALL_ATTENTION_FUNCTIONS.keys()),
            "attention_global": sorted(modeling_utils.AttentionInterface._global_mapping),
            "masks": sorted(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.keys()),
            "progress_bars": hf_logging.is_progress_bar_enabled(),
            "warning_filters": len(warnings.filters),
            "grad_enabled": torch.is_grad_enabled(),
        }

    # the libraries' own first-use caches (transformers fills some at its first model load): a
    # user's plain transformers + peft code runs first, so only what sess does shows below
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from sess.engine.runtime.catalog import prepare

    for name in ("tiny-llama", "tiny-gpt-oss"):
        own = AutoModelForCausalLM.from_pretrained(prepare(name))
        get_peft_model(own, LoraConfig(r=2, target_modules=["q_proj"]))(input_ids=__import__("torch").tensor([[1, 2]]))
    before = snapshot()
    from sess.engine import AdamParams, SamplingParams, ServiceClient
    from sess.engine.runtime import memory

    svc = ServiceClient("inproc")
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
    tok = tc.get_tokenizer()
    tc.forward_backward([tok.encode("The cat sat on the mat.")])
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    sc = tc.save_weights_and_get_sampling_client()
    futures = [sc.sample(tok.encode(p), 2, SamplingParams(max_tokens=6, seed=1)) for p in ("Hi", "A b c")]
    base = svc.create_sampling_client(base_model="tiny-llama").sample(tok.encode("Hi"), 1, SamplingParams(max_tokens=4))
    [f.result() for f in [*futures, base]]
    g = svc.create_lora_training_client("tiny-gpt-oss", rank=4, seed=0)
    g.forward_backward([tok.encode("one two three")]).result()
    g.create_sampling_client().sample(tok.encode("Hi"), 2, SamplingParams(max_tokens=4)).result()
    after = snapshot()
    changed = sorted(k for k in before if before[k] != after[k])
    print(json.dumps({"changed": changed, "malloc_tuned": memory._applied}))
    """
)


def test_an_in_process_engine_leaves_the_libraries_as_they_were(sess_home):
    """peft's, transformers' and torch's classes, functions and registries are unchanged after a
    session trains and samples in this process (llama: the lean decoder; gpt_oss: the modules), and
    the process's malloc settings are untouched."""
    out = subprocess.run(
        [sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, timeout=600, env=_env(sess_home)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert result == {"changed": [], "malloc_tuned": None}


def _env(home) -> dict:
    import os

    return {**os.environ, "SESS_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize(
    "module", ["sess.engine.sdk", "sess.engine.server.launcher", "sess.engine.server.settings"]
)
def test_client_side_modules_stay_light(module):
    code = f"import sys, {module}\nprint(sorted(m for m in ('torch', 'transformers', 'peft', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_composing_a_run_config_loads_no_torch():
    """``sess run --print-config``, ``--help`` and every read command compose configs or talk HTTP
    only; the loops import torch where their own work needs it (KTO's loss)."""
    code = (
        "import sys\nfrom sess.loops import config\nconfig.compose(['loop=kto'])\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


API_NAMES = (
    "ServiceClient TrainingClient SamplingClient APIFuture ModelInput EncodedTextChunk TensorData Datum "
    "SamplingParams AdamParams ForwardBackwardOutput OptimStepResponse SampleResponse SampledSequence "
    "SaveWeightsResponse SaveStateResponse LoadStateResponse TrainingSessionSummary SessionStatus "
    "LossFunction Usage"
).split()


def test_every_name_of_the_sdk_contract_imports_from_sess_engine():
    import sess.engine

    assert [name for name in API_NAMES if not hasattr(sess.engine, name)] == []
    assert set(API_NAMES) <= set(sess.engine.__all__)
