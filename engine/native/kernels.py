"""The sampler's C kernels, built once per machine for its CPU and called through typed wrappers.

``few_rows.c`` (the few-row matmul) and ``fused_ops.c`` (a decode step's attention, norms,
activation, token draws and logprobs) build into one library with OpenMP, ``-march=native`` and
``-ffp-contract=off`` (every sum is rounded as the source writes it, whatever the CPU offers),
cached on disk by :mod:`.build`; loaded, its threads are torch's own OpenMP team.

``kernels.h`` declares every kernel with its exact C types, and it is the one declaration both
sides read: the C sources are compiled against it, and :func:`declarations` parses it for the
Python side (each argument's ctypes width; each pointer's dtype). :data:`TENSORS` adds what C
cannot say, each tensor argument's rank and layout, and :func:`wrap` makes one Python function per
kernel that takes tensors, checks each one's dtype, rank and layout at the call (a few attribute
reads a tensor) and raises a ``TypeError`` or ``ValueError`` naming the kernel and the argument.
Shapes between arguments (rows, heads) are the callers' to check (:mod:`sess.engine.sampling.fused_ops`).

Where there is no compiler, the build fails, the cache cannot be written, or the library would
bring a second OpenMP runtime, :func:`library` says why and each caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from sess.engine.native.build import HEADERS, BuildError, build

SOURCES = ("few_rows.c", "fused_ops.c")
_OPENMP = ("libgomp", "libiomp", "libomp")
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_DTYPES = {"float": torch.float32, "double": torch.float64, "int64_t": torch.int64}
ADDRESS = "address"  # a raw address (an int), not a tensor: oneDNN's packed weight

# pointer argument -> (rank, layout): "dense" (contiguous) or "rows" (each row dense, rows strided)
TENSORS: dict[str, dict[str, tuple[int, str] | str]] = {
    "sess_few_rows": {"x": (2, "dense"), "w": ADDRESS, "y": (2, "dense")},
    "sess_decode_attention": {
        **{name: (3, "rows") for name in ("q", "k", "v")},
        **{name: (3, "dense") for name in ("cos", "sin", "q_cos", "q_sin", "out")},
        **{name: (5, "dense") for name in ("keys", "values")},
        **{name: (1, "dense") for name in ("positions", "sources", "shared", "places")},
    },
    "sess_prefill_attention": {
        "q": (3, "rows"),
        **{name: (3, "dense") for name in ("q_cos", "q_sin", "keys", "values", "out")},
        **{name: (1, "dense") for name in ("positions", "splits", "lows", "highs")},
    },
    "sess_rms_norm": {
        **{name: (2, "rows") for name in ("x", "residual")},
        **{name: (1, "dense") for name in ("weight",)},
        **{name: (2, "dense") for name in ("sum", "out")},
    },
    "sess_silu_mul": {"gate": (2, "rows"), "up": (2, "rows"), "out": (2, "dense")},
    "sess_draw": {
        "logits": (2, "rows"),
        **{name: (1, "dense") for name in ("temperature", "u", "tokens", "logprobs")},
        "tiles": (2, "dense"),
    },
    "sess_logprobs": {"logits": (2, "rows"), "tokens": (1, "dense"), "logprobs": (1, "dense")},
}
OPTIONAL = {("sess_decode_attention", n) for n in ("sources", "shared", "places")} | {
    ("sess_rms_norm", "residual"),
    ("sess_rms_norm", "sum"),  # read and written only with a residual
}


@functools.cache
def library() -> tuple[SimpleNamespace | None, str]:
    """The kernels built for this CPU and loaded, with how; (None, why not) where they cannot be."""
    kernels, how = load("native")
    if kernels is None:
        return None, how
    runtimes = _openmp_runtimes()
    if runtimes is None or len(runtimes) > 1:
        return None, f"not used: OpenMP runtimes in the process {runtimes or 'unknown'} (one is torch's)"
    return kernels, how


def load(arch: str) -> tuple[SimpleNamespace | None, str]:
    """The kernels built for the CPU ``arch`` (``-march``; from the cache where they are in it),
    each a typed wrapper (:func:`wrap`); (None, why not) where they cannot be built or loaded."""
    flags = ("-O3", f"-march={arch}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi")
    try:
        built = build("sess_kernels", SOURCES, flags, suffix=".so")
        lib = ctypes.CDLL(str(built.path))
    except (BuildError, OSError) as exc:  # OSError: a noexec cache dir
        return None, f"not built: {exc}"
    how = "built" if built.compiled else "loaded from the build cache"
    return SimpleNamespace(**{n: wrap(lib, n, args) for n, args in declarations().items()}), (
        f"{how} for this CPU ({built.path.name})"
    )


def built() -> bool:
    """Whether :func:`library` has been asked yet (the kernels are loaded on first use, not by
    asking how they are)."""
    return bool(library.cache_info().currsize)


@functools.cache
def declarations() -> dict[str, list[tuple[str, str]]]:
    """Each kernel kernels.h declares -> its arguments as (name, C type: ``float *``, ``int64_t``),
    every pointer's layout given by :data:`TENSORS` (a mismatch raises here, when the kernels load)."""
    text = re.sub(r"/\*.*?\*/", "", HEADERS[0].read_text(), flags=re.S)
    found = {}
    for name, args in re.findall(r"\bint\s+(sess_\w+)\s*\(([^)]*)\)\s*;", text):
        parsed = [re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)\s*", arg) for arg in args.split(",")]
        if None in parsed:
            raise TypeError(f"kernels.h: {name}'s arguments are not of the forms this file reads")
        found[name] = [(m[3], m[1] + (" *" if m[2] else "")) for m in parsed]
        pointers = {arg for arg, ctype in found[name] if ctype.endswith("*")}
        if pointers != set(TENSORS.get(name, {})):
            raise TypeError(f"kernels.h: {name}'s pointers {sorted(pointers)} differ from TENSORS")
    if set(found) != set(TENSORS):
        raise TypeError(f"kernels.h declares {sorted(found)}, TENSORS {sorted(TENSORS)}")
    return found


def wrap(lib: ctypes.CDLL, name: str, args: list[tuple[str, str]]):
    """The kernel ``name`` of ``lib`` with ctypes of the declared widths, behind a function that
    takes each pointer as a tensor (or None where optional; an int where :data:`ADDRESS`), checks
    its dtype, rank and layout, and passes its data pointer."""
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p if c.endswith("*") else _SCALARS[c] for _, c in args]
    fn.restype = ctypes.c_int
    lines, passed = [], []
    for arg, ctype in args:
        spec = TENSORS[name].get(arg)
        if spec is None or spec == ADDRESS:
            passed.append(arg)
            continue
        rank, layout = spec
        dtype = _DTYPES[ctype.removesuffix(" *")]
        check = f"not isinstance({arg}, _Tensor) or {arg}.dtype is not {_name(dtype)} or " + (
            f"{arg}.dim() != {rank} or not {arg}.is_contiguous()"
            if layout == "dense"
            else _not_rows(arg, rank)
        )
        why = f"_bad({name!r}, {arg!r}, {arg}, {_name(dtype)}, {rank}, {layout!r})"
        optional = (name, arg) in OPTIONAL
        lines.append(f"    if {f'{arg} is not None and (' + check + ')' if optional else check}: {why}")
        passed.append(f"{arg}.data_ptr()" + (f" if {arg} is not None else None" if optional else ""))
    source = f"def {name}({', '.join(a for a, _ in args)}):\n" + "\n".join(lines)
    source += f"\n    try:\n        return _fn({', '.join(passed)})"
    source += f"\n    except _ArgumentError as exc:\n        _unconverted({name!r}, {[a for a, _ in args]!r}, exc)\n"
    scope = {
        "_fn": fn,
        "_bad": _bad,
        "_unconverted": _unconverted,
        "_ArgumentError": ctypes.ArgumentError,
        "_Tensor": torch.Tensor,
        "torch": torch,
    }
    exec(compile(source, f"<sess kernel {name}>", "exec"), scope)  # one straight-line check per tensor
    scope[name].c_function = fn
    return scope[name]


def _unconverted(kernel: str, names: list[str], exc: ctypes.ArgumentError):
    """ctypes' "argument 3: wrong type" as a TypeError naming the argument."""
    found = re.match(r"argument (\d+): (.*)", str(exc), flags=re.S)
    arg = names[int(found[1]) - 1] if found else "?"
    raise TypeError(f"{kernel}: argument {arg!r}: {found[2] if found else exc}") from None


def _bad(kernel: str, arg: str, value, dtype: torch.dtype, rank: int, layout: str):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{kernel}: argument {arg!r} must be a tensor, not {type(value).__name__}")
    got = f"{value.dtype} of shape {tuple(value.shape)}, strides {value.stride()}"
    raise ValueError(
        f"{kernel}: argument {arg!r} must be a {layout} {dtype} tensor of rank {rank}, not {got}"
    )


def _not_rows(arg: str, rank: int) -> str:
    """The test that ``arg`` is not of rank ``rank`` with each row dense (its trailing dims
    contiguous; the rows at any stride), reading its shape and strides once (each read of a
    tensor's attribute is a call into torch: ~0.1-0.5 us)."""
    shape, strides = f"_shape_{arg}", f"_strides_{arg}"
    checks = [f"len({shape} := {arg}.shape) != {rank}", f"({strides} := {arg}.stride())[-1] != 1"] + [
        f"({shape}[{d}] != 1 and {strides}[{d}] != {strides}[{d + 1}] * {shape}[{d + 1}])"
        for d in range(1, rank - 1)
    ]
    return " or ".join(checks)


def _name(dtype: torch.dtype) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}"


def _openmp_runtimes() -> set[str] | None:
    """The OpenMP libraries mapped into this process (None where that cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6}
    return {p for p in paths if Path(p).name.startswith(_OPENMP)}
