"""``data=env``: any :class:`~sess.rl.env.Env` of your own, named ``path/to/file.py:Name`` or ``package.module:Name``.

``Name(rng)`` builds one episode of a problem drawn from ``rng`` (a ``random.Random`` seeded by
(seed, split, k), so a group's envs share their problem and item k is the same in every run).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from sess.rl.data import Data, Dataset
from sess.rl.env import EnvFactory


@dataclass
class EnvData:
    name: str = "env"
    env: str = MISSING  # path/to/file.py:Name or package.module:Name; Name(rng) -> an Env
    eval_size: int = 16


def load_env(cfg: EnvData, seed: int) -> Data:
    make = import_named(cfg.env, "data.env")

    def factory(split: str, k: int) -> EnvFactory:
        return lambda: make(random.Random(f"{seed}/{split}/{k}"))

    held = [factory("eval", k) for k in range(cfg.eval_size)]
    return Data("env", envs=Dataset(lambda k: factory("train", k), held))


def import_named(spec: str, key: str):
    """``file.py:Name`` or ``package.module:Name`` (importable from the working directory) -> the object."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{key}: expected path/to/file.py:Name or package.module:Name, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"{key}: no such file {where!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module  # dataclasses in the file look their module up there
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:  # `sess run` is a console script: its sys.path lacks the cwd
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{key}: {where} has no {name!r}")
    return getattr(module, name)
