"""The shape of sess: packages as layers that import only downwards (inside functions too), no import
cycles, a light SDK, short files, docs in code that describe rather than narrate, and an in-process
engine that leaves the libraries it uses as it found them."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
# Every package of sess, by folder (pyproject's package-dir maps sess.<name> to <name>/).
PACKAGES = ("cli", "conf", "engine", "harness", "loops", "rl", "sandbox", "tasks")
# The layers, top first: a layer may import itself and the layers after it in any chain holding both,
# never one before it. The client side: the CLI drives the run harness, which runs the loops on the
# tasks; the loops and tasks are built from the RL machinery, which speaks to an engine through the
# SDK only. The engine side: the server serves the runtime, which samples with the sampling layer,
# and both build and load their C through the native room below them (which imports nothing of
# sess), and reach a library's internals only through the seams of engine.libraries (nothing of sess
# either). Both sides speak the protocol (wire types, requests, errors, checks, the engine home), the
# one layer they share: no chain holds both the SDK and the server or runtime, so the engine never
# imports the client package. The CLI also starts and manages the engine; tasks grade in the sandbox.
CHAINS = (
    ("cli", "harness", "loops", "tasks", "rl", "engine.sdk", "engine.protocol"),
    ("tasks", "sandbox"),
    ("cli", "engine.server", "engine.runtime", "engine.sampling", "engine.protocol"),
    ("engine.runtime", "engine.sampling", "engine.native"),
    ("engine.runtime", "engine.sampling", "engine.libraries"),
)
LAYERS = sorted({layer for chain in CHAINS for layer in chain} | {"conf"})


def _module_name(path: Path) -> str:
    return ("sess." + ".".join(path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _imports(path: Path, *, entry_points: bool = False, functions: bool = True) -> set[str]:
    """The sess modules ``path`` imports anywhere (module level and, with ``functions``, inside
    functions), resolved from relative imports; not annotation-only imports (``if TYPE_CHECKING:``)
    and, unless ``entry_points``, not those of an ``if __name__ == "__main__":`` block (an entry point
    runs at the top, like the CLI)."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" in test or (not entry_points and "__name__ ==" in test):
                skipped.update(id(child) for child in ast.walk(node))
        if not functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            skipped.update(id(child) for child in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.startswith("sess"):
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("sess"))
    return found


def _graph(**options) -> dict[str, set[str]]:
    """Module -> the sess modules it imports (modules of sess only, not names inside them)."""
    graph = {
        _module_name(path): _imports(path, **options)
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[1] == "engine":  # sess.engine itself re-exports the SDK
        return (
            "engine." + parts[2]
            if len(parts) > 2 and parts[2] in ("sdk", "protocol", "server", "runtime", "sampling", "native", "libraries")
            else "engine.sdk"
        )
    return parts[1]


def _may_import(importer: str, imported: str) -> bool:
    if importer == imported:
        return True
    return any(
        importer in chain and imported in chain and chain.index(importer) < chain.index(imported)
        for chain in CHAINS
    )


def test_every_package_is_a_layer():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} == set(PACKAGES)
    assert {p.name for p in ENGINE.iterdir() if p.is_dir() and not p.name.startswith("_")} == {
        "sdk",
        "protocol",
        "server",
        "runtime",
        "sampling",
        "native",
        "libraries",
    }
    assert {_layer(m) for m in _graph()} == set(LAYERS)


def test_imports_point_only_down_even_inside_functions():
    upward = sorted(
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        for dep in deps
        if not _may_import(_layer(module), _layer(dep))
    )
    assert upward == []


def test_the_engine_imports_the_protocol_never_the_client_package():
    """The server, runtime and sampling layers read the wire types, errors and the engine home from
    the protocol; the SDK is the client's. The protocol imports nothing of sess outside itself."""
    engine_side = ("engine.server", "engine.runtime", "engine.sampling", "engine.native")
    graph = _graph(entry_points=True)
    into_the_sdk = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if _layer(module) in engine_side and _layer(dep) == "engine.sdk"
    )
    assert into_the_sdk == []
    out_of_the_protocol = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if _layer(module) == "engine.protocol" and _layer(dep) != "engine.protocol"
    )
    assert out_of_the_protocol == []
    for engine_layer in engine_side:
        assert not _may_import(engine_layer, "engine.sdk")
        assert not _may_import("engine.protocol", engine_layer)
    assert _may_import("engine.sdk", "engine.protocol") and _may_import("engine.server", "engine.protocol")


HEAVY = ("torch", "transformers", "peft", "fastapi")


def test_the_protocol_imports_no_torch_at_module_level():
    """Importing every protocol module loads no torch, transformers, peft or fastapi (a conversion
    such as ``TensorData.to_torch`` imports torch inside the function that needs it)."""
    modules = sorted(_module_name(p) for p in (ENGINE / "protocol").glob("*.py"))
    assert "sess.engine.protocol.types" in modules and "sess.engine.protocol.home" in modules
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    top_level = sorted(
        f"{p.name}:{node.lineno}"
        for p in (ENGINE / "protocol").glob("*.py")
        for node in ast.parse(p.read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (name or "").split(".")[0] in HEAVY
            for name in ([node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        )
    )
    assert top_level == []


def test_the_architecture_test_sees_imports_inside_functions():
    """A function-level import counts: the check above is not blind to them."""
    body = "def f():\n    from sess.engine.server import http_app\n"
    path = ROOT / "engine" / "sdk" / "_probe_for_the_test.py"
    path.write_text(body)
    try:
        deps = _imports(path)
    finally:
        path.unlink()
    assert "sess.engine.server.http_app" in deps and not _may_import("engine.sdk", "engine.server")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return [*path, module, dep]
            if dep not in state and (found := visit(dep, [*path, module])):
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def test_no_import_cycles_anywhere_even_counting_entry_points():
    """Counting what ``if __name__ == "__main__":`` blocks import: a module run as a script must not
    import what imports it (``python -m sess.harness`` runs a loop; a loop never runs the harness)."""
    cycle = _cycle(_graph(entry_points=True))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    body = 'if __name__ == "__main__":\n    from sess.harness.runner import main\n'
    path = ROOT / "loops" / "_probe_for_the_test.py"
    path.write_text(body)
    try:
        assert "sess.harness.runner" in _imports(path, entry_points=True)
    finally:
        path.unlink()


def test_no_module_swaps_entries_of_sys_modules():
    """Aliasing ``sys.modules`` (so that a module run as ``__main__`` is also its importable self)
    hides a cycle; a loop runs through ``python -m sess.harness loop=NAME`` instead."""
    swapping = sorted(
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Assign)
        and ast.unparse(node.value).startswith("sys.modules[")
        and any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in node.targets)
    )
    assert swapping == []


def test_the_harness_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "sess.harness", "--help"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("usage: python -m sess.harness")


def test_files_read_in_one_sitting():
    long = {
        str(p.relative_to(ROOT)): n
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 420
    }
    assert long == {}


# Prose in code says what and why; dated figures, commit hashes, review rounds and issue numbers
# belong in git and benchmarks/README.md, where they do not drift from the code they describe.
NARRATION = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a round": re.compile(
        r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)|memory|review)"
        r"\s+round\b|\brounds?\s+\d+\b",
        re.I,
    ),
    "an issue number": re.compile(r"\bissues?\s+#?\d+\b|\bPR\s+#?\d+\b", re.I),
}
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")


def _narration(text: str) -> list[str]:
    """What in ``text``'s comments and strings (docstrings, --help) quotes a date, a round, an issue
    number or a commit-hash-looking token."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for what, pattern in [*NARRATION.items(), ("a commit hash", COMMIT)]:
                found += [
                    f"line {tok.start[0]}: {what}: {m.group(0)!r}" for m in pattern.finditer(tok.string)
                ]
    return found


def test_code_describes_rather_than_narrates():
    quoted = {
        str(p.relative_to(ROOT)): found
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if (found := _narration(p.read_text()))
    }
    assert quoted == {}
    narrated = '''"""Measured 2026-12-01 at 5c520ab (eighth round, issue 14)."""\nx = 1  # see round 3\n'''
    assert len(_narration(narrated)) == 5
    assert _narration('''"""A sha256 is 64 hex digits; 0x1f and 2026 are numbers."""\n''') == []


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
    from sess.engine.runtime.models.catalog import prepare

    for name in ("tiny-llama", "tiny-gpt-oss"):
        own = AutoModelForCausalLM.from_pretrained(prepare(name))
        get_peft_model(own, LoraConfig(r=2, target_modules=["q_proj"]))(input_ids=__import__("torch").tensor([[1, 2]]))
    before = snapshot()
    from sess.engine import AdamParams, SamplingParams, ServiceClient
    from sess.engine.runtime.memory import malloc_tuning as memory
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
    print(json.dumps({"changed": changed, "malloc_tuned": memory.tuned()}))
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
    "module",
    [
        "sess.engine.sdk",
        "sess.engine.protocol",
        "sess.engine.sdk.local_engine",
        "sess.engine.server.settings",
    ],
)
def test_client_side_modules_stay_light(module):
    code = f"import sys, {module}\nprint(sorted(m for m in ('torch', 'transformers', 'peft', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_composing_a_run_config_loads_no_torch():
    """``sess run --print-config``, ``--help`` and every read command compose configs or talk HTTP
    only; the loops import torch where their own work needs it (KTO's loss)."""
    code = (
        "import sys\nfrom sess.harness import config\nconfig.compose(['loop=kto'])\n"
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


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _loss_lists(source: str, names: set[str]) -> list[str]:
    """Where ``source`` spells several loss names together, a fact the loss registry keeps: a tuple,
    list, set or dict keys mostly of them, a class body assigning them (an enum), or a string (not a
    docstring) listing three or more ("a, b, c"). One name where a loss is used (``loss_fn="ppo"``)
    is no list."""
    alternatives = "|".join(sorted(names))
    listing = re.compile(rf"\b({alternatives})(,\s*({alternatives})\b){{2,}}")
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        items = (
            node.elts
            if isinstance(node, ast.Tuple | ast.List | ast.Set)
            else node.keys
            if isinstance(node, ast.Dict)
            else [s.value for s in node.body if isinstance(s, ast.Assign)]
            if isinstance(node, ast.ClassDef)
            else []
        )
        strings = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        named = [v for v in strings if v in names]
        if len(set(named)) >= 2 and 2 * len(named) > len(strings):
            found.append(f"line {node.lineno}: {', '.join(named)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [f"line {node.lineno}: {m.group(0)!r}" for m in listing.finditer(node.value)]
    return found


def test_loss_names_are_listed_only_in_the_loss_registry():
    """The SDK's LossFunction, the batch checks, the engine's formulas and the loops' checks read
    :mod:`sess.engine.protocol.loss_registry`; a second list of loss names would drift from it."""
    from sess.engine.protocol import loss_registry

    names = set(loss_registry.LOSSES) | set(loss_registry.REFUSED)
    registry = ROOT / "engine" / "protocol" / "loss_registry.py"
    listed = {
        str(p.relative_to(ROOT)): found
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p != registry and (found := _loss_lists(p.read_text(), names))
    }
    assert listed == {}
    probe = textwrap.dedent(
        """
        class LossFunction(str, enum.Enum):
            ppo = "ppo"
            dro = "dro"
        LOSSES = ("ppo", "cispo")
        HELP = {"loss_fn": "cross_entropy, ppo, cispo; custom refused"}
        LOOPS = {"sft": 1, "grpo": 2, "ppo": 3, "importance_sampling": 4, "kto": 5}
        tc.forward_backward(datums, loss_fn="ppo")
        """
    )
    assert len(_loss_lists(probe, names)) == 3


TEST_FOLDERS = {
    "sdk",
    "runtime",
    "sampling",
    "native",
    "libraries",
    "server",
    "tinker",
    "cli",
    "harness",
    "loops",
    "rl",
    "tasks",
    "sandbox",
}


def test_tests_mirror_the_packages_and_share_only_helper_modules():
    """A package's tests live in tests/<its layer>/; what several share is in a helper module
    (conftest.py, helpers.py, ...), never imported from another test file."""
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - {"tinker_scripts"} == TEST_FOLDERS
    assert {p.name for p in tests.glob("test_*.py")} == {
        "test_architecture.py",
        "test_references.py",
    }  # cross-package
    borrowing = sorted(
        f"{p.relative_to(tests)}: {line.strip()}"
        for p in tests.rglob("*.py")
        for line in p.read_text().splitlines()
        if re.match(r"\s*(from|import) test_\w+", line)
    )
    assert borrowing == []


# Op names in sets beside the op table drift from it: what an op needs done around it is a column of
# its row (engine/runtime/ops/table.py). The SDK, which may not import the table (it brings torch),
# keeps the client's side of each control call in a table of its own (engine/protocol/calls.py) and is
# held to it the same way.
TABLE = ENGINE / "runtime" / "ops" / "table.py"
CALLS = ENGINE / "protocol" / "calls.py"
TABLE_READERS = ("engine/runtime", "engine/server", "engine/sdk", "engine/protocol", "cli")


def _op_names() -> set[str]:
    for node in ast.walk(ast.parse(TABLE.read_text())):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "OPS":
            return {key.value for key in node.value.keys}
    raise AssertionError("no OPS table in engine/runtime/ops/table.py")


def _op_name_sets(text: str, ops: set[str]) -> list[str]:
    """Set, list and tuple literals of two or more strings that are all op names."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Set, ast.List, ast.Tuple)) and len(node.elts) >= 2:
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(names) == len(node.elts) and set(names) <= ops:
                found.append(f"line {node.lineno}: {', '.join(names)}")
    return found


def test_what_an_op_needs_is_a_column_of_the_op_table_not_a_set_of_names():
    ops = _op_names()
    sets = {
        str(p.relative_to(ROOT)): found
        for folder in TABLE_READERS
        for p in (ROOT / folder).rglob("*.py")
        if p not in (TABLE, CALLS) and (found := _op_name_sets(p.read_text(), ops))
    }
    assert sets == {}
    assert {"forward", "sample", "optim_step"} <= ops
    assert _op_name_sets('COSTLY = {"forward", "sample"}\nif name in ("noop", "forward"): pass\n', ops) == [
        "line 1: forward, sample",
        "line 2: noop, forward",
    ]
    assert _op_name_sets('MODES = ("forward", "sideways")\n', ops) == []


def test_the_sdk_call_table_names_the_engine_control_ops():
    from sess.engine.protocol.calls import CALLS
    from sess.engine.runtime.ops.table import OPS, Kind

    assert set(CALLS) == {name for name, op in OPS.items() if op.kind is Kind.CONTROL}
    # a call that changes the engine is never sent twice; reads are
    assert not any(
        CALLS[name].reads_only for name, op in OPS.items() if op.kind is Kind.CONTROL and op.accounted
    )


# A module's private names (a leading underscore) are its own: another module uses what it offers
# in public. Access through self or cls (a subclass's own state) is the class's business. Names
# sess defines that a library also uses as its own private attribute are not sess's reach.


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _named_attribute(node: ast.AST) -> str | None:
    """The attribute name a ``getattr``/``setattr``/``hasattr`` call names as a string constant."""
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", "") in ("getattr", "setattr", "hasattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _reaches(trees: dict[str, ast.AST]) -> list[str]:
    """``from sess.x import _y`` anywhere, and ``obj._y`` / ``getattr(obj, "_y")`` where ``_y`` is a
    private name of another sess module and ``obj`` is not ``self`` or ``cls``."""
    own = {name: _defined_privates(tree) for name, tree in trees.items()}
    sess_privates = set().union(*own.values())
    found = []
    for name, tree in trees.items():
        foreign = sess_privates - own[name]
        for node in ast.walk(tree):
            reached = None
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sess"):
                reached = ", ".join(a.name for a in node.names if _private(a.name)) or None
            elif isinstance(node, ast.Attribute) and node.attr in foreign:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    reached = node.attr
            elif (attr := _named_attribute(node)) in foreign:
                reached = attr
            if reached:
                found.append(f"{name}:{node.lineno}: {reached}")
    return found


def test_no_module_reaches_into_another_modules_privates():
    trees = {
        str(p.relative_to(ROOT)): ast.parse(p.read_text())
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if not str(p.relative_to(ROOT)).startswith(SEAMS)  # a library's privates, by design
    }
    assert _reaches(trees) == []
    probe = {
        "a.py": ast.parse(
            "class A:\n    def __init__(self):\n        self._n = 1\n    def f(self, o):\n        return o._n\n"
        ),
        "b.py": ast.parse(
            "from sess.a import _helper\n"
            "def g(a):\n    return a._n + getattr(a, '_n')\n"
            "class B:\n    def h(self):\n        return self._n\n"
        ),
    }
    assert _reaches(probe) == ["b.py:1: _helper", "b.py:3: _n", "b.py:3: _n"]


# where a library's internals may be used: the seams, one function each, with the versions checked
SEAMS = ("engine/libraries/",)
STDLIB_PRIVATES = {"_exit"}  # os._exit: the sandbox's job runner ends the solution's process with it


def _library_reaches(trees: dict[str, ast.AST]) -> list[str]:
    """Outside the seams: ``obj._y`` where ``_y`` is no name sess defines and ``obj`` is not
    ``self``/``cls`` (so a library's private: ``torch._foo``, ``module._parameters``, ``t._version``),
    ``getattr``/``setattr``/``hasattr`` of such a name, an assignment to a module's ``forward``
    (anything's but ``self``'s) and an attribute named ``_sess...`` set on anything."""
    ours = set().union(*(_defined_privates(tree) for tree in trees.values()))
    found = []
    for name, tree in trees.items():
        if name.startswith(SEAMS):
            continue
        for node in ast.walk(tree):
            reached = None
            if isinstance(node, ast.Attribute) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                sets = isinstance(node.ctx, ast.Store)
                if sets and (node.attr == "forward" or node.attr.startswith("_sess")):
                    reached = f"sets {node.attr}"
                elif _private(node.attr) and node.attr not in ours and node.attr not in STDLIB_PRIVATES:
                    reached = node.attr
            elif (attr := _named_attribute(node)) is not None:
                if attr == "forward" and node.func.id == "setattr" or attr.startswith("_sess"):
                    reached = f"{node.func.id} {attr}"
                elif _private(attr) and attr not in ours:
                    reached = f"{node.func.id} {attr}"
            if reached:
                found.append(f"{name}:{node.lineno}: {reached}")
    return found


def test_library_internals_are_reached_only_through_the_seams():
    """No product module outside engine/libraries reads a library's private names, replaces a
    module's ``forward`` or marks a library object with an attribute of its own."""
    trees = {
        str(p.relative_to(ROOT)): ast.parse(p.read_text())
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
    }
    assert _library_reaches(trees) == []
    probe = {
        "engine/x.py": ast.parse(
            "import torch\n"
            "def f(m, t):\n"
            "    m.forward = g\n"
            "    m._sess_recipes = True\n"
            "    setattr(m, '_sess_mark', 1)\n"
            "    return torch._log_softmax_backward_data, t._version, m._modules, self._own\n"
        ),
        "engine/libraries/torch_internals.py": ast.parse("def v(t):\n    return t._version\n"),
    }
    assert _library_reaches(probe) == [
        "engine/x.py:3: sets forward",
        "engine/x.py:4: sets _sess_recipes",
        "engine/x.py:5: setattr _sess_mark",
        "engine/x.py:6: _log_softmax_backward_data",
        "engine/x.py:6: _version",
        "engine/x.py:6: _modules",
    ]


# The engine's two optional modes are objects the runtime holds, chosen when it starts: where the work
# runs (engine/runtime/placement.py: one process, or several ranks in distributed/) and who samples
# (engine/runtime/samplers.py: the built-in decode batch, or vllm/). The ops call their methods and never
# ask which mode is on, nor import the modes' rooms: those rooms import the ops.
RUNTIME = ENGINE / "runtime"
MODE_QUESTION = re.compile(r"runtime.ranks|runtime.vllm")


def test_the_ops_never_ask_which_mode_is_on():
    asking = {
        str(p.relative_to(ROOT)): [
            line.strip() for line in p.read_text().splitlines() if MODE_QUESTION.search(line)
        ]
        for p in sorted((RUNTIME / "ops").glob("*.py"))
    }
    assert {path: lines for path, lines in asking.items() if lines} == {}
    modes = ("sess.engine.runtime.distributed", "sess.engine.runtime.vllm")
    importing = sorted(
        f"{p.relative_to(ROOT)} -> {dep}"
        for p in (RUNTIME / "ops").glob("*.py")
        for dep in _imports(p)
        if dep.startswith(modes)
    )
    assert importing == []
    assert MODE_QUESTION.search("if runtime.ranks is not None:") and not MODE_QUESTION.search(
        "runtime.placement"
    )


def _runtime_rooms(**options) -> dict[str, set[str]]:
    """engine/runtime's rooms (each sub-package or module right under it) -> the rooms they import."""
    modules = {_module_name(p): _imports(p, **options) for p in RUNTIME.rglob("*.py")}

    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[3] if len(parts) > 3 else None  # the package itself (its __init__) is no room

    rooms: dict[str, set[str]] = {r: set() for m in modules if (r := room(m))}
    for module, deps in modules.items():
        if (mine := room(module)) is not None:
            rooms[mine] |= {r for dep in deps if dep in modules and (r := room(dep)) not in (None, mine)}
    return rooms


def test_no_import_cycle_between_the_runtime_rooms():
    """Counting what each module imports at its top (not inside functions, not for type checkers
    only): ops/ and the rooms under it (checkpoints, models, memory, sessions, the runtime, the
    placement and sampler protocols) never import the rooms above them (distributed/, vllm/, the
    executor) nor one another in a circle."""
    rooms = _runtime_rooms(functions=False)
    assert {"ops", "distributed", "vllm", "runtime", "placement", "samplers"} <= set(rooms)
    cycle = _cycle(rooms)
    assert cycle is None, f"import cycle between engine/runtime's rooms: {' -> '.join(cycle)}"
    assert "ops" in rooms["distributed"] and "distributed" not in rooms["ops"]
    body = "import sess.engine.runtime.ops.table\ndef f():\n    import sess.engine.runtime.executor\n"
    path = RUNTIME / "distributed" / "_probe_for_the_test.py"
    path.write_text(body)
    try:
        found = _imports(path, functions=False)
    finally:
        path.unlink()
    assert "sess.engine.runtime.ops.table" in found and "sess.engine.runtime.executor" not in found


def test_every_package_is_installed():
    """pyproject's package list names every folder with an ``__init__.py``: an editable install finds
    a folder left out, a wheel does not ship it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        _module_name(init.parent / "__init__.py")
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }
    assert found - listed == set() and listed - found == set()
