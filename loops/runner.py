"""``sess run``: a composed config -> a session on an engine -> a loop module, with records and evals.

The runner owns everything a loop should not have to think about: it connects to the engine the
config names, creates (or reuses, or restores) the training session, writes the run directory,
evaluates on held-out data at the start, every ``loop.eval_every`` steps and at the end (greedy
accuracy on problems, token loss on chats), saves state every ``loop.save_every`` steps and at the end,
records usage and stops the session unless ``keep_session``. A loop module gets a :class:`Run` and
calls :meth:`Run.step_done` after each optimizer step.

Seeds: the session's LoRA init uses ``seed``; item k of the data order is a function of (seed, k); the
sampling seed of prompt i at step s is a hash of (seed, s, i). So a replay of a recorded config
reproduces its metrics, and a resume from a state saved at step n continues exactly as the
uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sess.engine import SamplingParams, ServiceClient, TrainingClient

from . import config as config_mod
from . import datasets, rendering, rewards
from .records import Logger, RunRecord, new_run_dir
from .registry import LOOPS


class RunInterrupted(Exception):
    """Raised by an ``on_step`` hook to stop a run as if it were killed (tests use it)."""


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from parts (run seed, step, prompt index, ...): stable across processes and machines."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def service_client(engine_cfg) -> ServiceClient:
    if engine_cfg.kind == "inprocess":
        return ServiceClient("inproc")
    if engine_cfg.kind == "remote":
        return ServiceClient(engine_cfg.url, engine_cfg.api_key)
    return ServiceClient()  # local: the engine of SESS_HOME


def plan(cfg: DictConfig) -> dict:
    """What a run would do, without touching an engine or weights (``--dry-run``)."""
    lora = cfg.model.lora
    return {
        "model": cfg.model.base_model,
        "arch": cfg.model.arch,
        "lora": f"rank {lora.rank}, alpha {lora.alpha}; targets {', '.join(cfg.model.targets)}",
        "engine": cfg.engine.kind + (f" {cfg.engine.url}" if cfg.engine.url else ""),
        "loop": f"{cfg.loop.name}: {cfg.loop.steps} steps, batch {cfg.loop.batch_size}, lr {cfg.loop.learning_rate}",
        "data": cfg.data.name,
        "eval": f"every {cfg.loop.eval_every or '-'} steps and at start/end",
        "save": f"state every {cfg.loop.save_every or '-'} steps and at the end",
        "logger": cfg.logger.name,
        "seed": cfg.seed,
    }


@dataclass
class Run:
    """What a loop sees: the config, the SDK clients, the data, and the hooks that record progress."""

    cfg: DictConfig
    svc: ServiceClient
    tc: TrainingClient
    tok: Any
    data: datasets.TaskData
    record: RunRecord
    logger: Logger
    start_step: int = 0
    on_step: Callable[[int], None] | None = None
    progress: Any = None
    _last_saved: int = -1
    _started: float = field(default_factory=time.perf_counter)

    @property
    def loop(self) -> DictConfig:
        return self.cfg.loop

    @property
    def seed(self) -> int:
        return int(self.cfg.seed)

    def sampling_params(self, step: int, index: int, *, greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.loop.max_tokens,
            temperature=0.0 if greedy else self.loop.temperature,
            seed=derive_seed(self.seed, "sample", step, index),
        )

    # progress ------------------------------------------------------------------------------------
    def step_done(self, step: int, metrics: dict) -> None:
        """Record step ``step`` (0-based) as done; evaluate and save when due."""
        done = step + 1
        row = {"kind": "train", "step": done, **{k: _plain(v) for k, v in metrics.items()}}
        self.logger.log(row)
        if self.progress is not None:
            self.progress.update(done, row)
        if self.loop.eval_every and done % self.loop.eval_every == 0 and done < self.loop.steps:
            self.evaluate(done)
        if self.loop.save_every and done % self.loop.save_every == 0:
            self.save(done)
        if self.on_step is not None:
            self.on_step(done)

    def evaluate(self, done: int) -> dict:
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.data.eval_problems:
            metrics.update(greedy_accuracy(self, self.data.eval_problems, done))
        elif self.data.eval_chats:
            metrics.update(chat_loss(self, self.data.eval_chats))
        extra = getattr(LOOPS[self.loop.name], "evaluate", None)
        if extra is not None:
            metrics.update(extra(self))
        metrics["eval/seconds"] = time.perf_counter() - started
        self.logger.log({"kind": "eval", "step": done, **metrics})
        if self.progress is not None:
            self.progress.note_eval(done, metrics)
        return metrics

    def save(self, done: int) -> str:
        path = self.tc.save_state(name=f"step{done:06d}").result().path
        self.record.append("checkpoints.jsonl", {"step": done, "kind": "state", "path": path})
        self._last_saved = done
        return path


def greedy_accuracy(run: Run, problems: list, done: int) -> dict:
    sc = run.tc.create_sampling_client()
    futures = []
    for i, problem in enumerate(problems):
        prompt = rendering.prompt_tokens(run.tok, run.data.prompt(problem))
        futures.append(sc.sample(prompt, 1, run.sampling_params(done, i, greedy=True)))
    texts = [run.tok.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    hits = [rewards.correct(t, p.answer) for t, p in zip(texts, problems)]
    parsed = [rewards.parse_answer(t) is not None for t in texts]
    return {
        "eval/accuracy": sum(hits) / len(hits),
        "eval/parsed": sum(parsed) / len(parsed),
        "eval/n": len(hits),
    }


def chat_loss(run: Run, chats: list) -> dict:
    datums, total = [], 0.0
    for chat in chats:
        tokens, weights = rendering.chat_tokens(run.tok, chat)
        datums.append(rendering.shifted_datum(tokens, weights=weights))
        total += sum(weights[1:])
    out = run.tc.forward(datums, "cross_entropy").result()
    return {"eval/loss": out.metrics["loss:sum"] / max(total, 1.0)}


def _plain(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") and not isinstance(value, bool | int) else value


# ------------------------------------------------------------------------------------------- execute


def start(
    overrides: list[str] | tuple[str, ...] = (),
    *,
    session: str | None = None,
    on_step: Callable[[int], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Compose, run and record a fresh run; returns its directory."""
    overrides = list(overrides)
    if session is not None:
        overrides.append(f"session={session}")
    cfg = config_mod.compose(overrides)
    run_dir = new_run_dir(cfg.runs_dir, cfg.loop.name, cfg.model.name)
    record = RunRecord.create(run_dir, config_mod.to_yaml(cfg), overrides, _meta(cfg))
    _execute(cfg, record, start_step=0, resume_from=None, on_step=on_step, show_progress=show_progress)
    return run_dir


def resume(
    run_dir: str | Path,
    *,
    on_step: Callable[[int], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Continue a recorded run from its last saved state, at that step, with the same data order."""
    record = RunRecord(Path(run_dir))
    if not (record.path / "config.yaml").is_file():
        raise ValueError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
    cfg = config_mod.load(record.path / "config.yaml")
    state = record.last_state()
    if state is None:
        raise ValueError(
            f"--resume: {run_dir} has no saved state to resume from (checkpoints.jsonl is empty)"
        )
    record.truncate_after(state["step"])
    resumes = record.meta.get("resumes", [])
    record.update_meta(status="running", resumes=[*resumes, {"step": state["step"], "path": state["path"]}])
    _execute(
        cfg,
        record,
        start_step=state["step"],
        resume_from=state["path"],
        on_step=on_step,
        show_progress=show_progress,
    )
    return record.path


def _meta(cfg: DictConfig) -> dict:
    return {
        "loop": cfg.loop.name,
        "model": cfg.model.name,
        "steps": cfg.loop.steps,
        "seed": cfg.seed,
        "engine": {"kind": cfg.engine.kind, "url": cfg.engine.url},
    }


def _open_session(svc: ServiceClient, cfg: DictConfig, record: RunRecord, resume_from: str | None):
    # Run folders are unique per runs_dir only; one engine serves many folders, so add a tag.
    tag = secrets.token_hex(2)
    if resume_from is not None:
        name = f"{record.path.name}-r{len(record.meta.get('resumes', []))}-{tag}"
        return svc.create_training_client_from_state_with_optimizer(resume_from, training_session_name=name)
    name = cfg.session or f"{record.path.name}-{tag}"
    if cfg.session and any(s.name == name and s.status == "Running" for s in svc.list_sessions()):
        return svc.get_training_client(name)
    lora = cfg.model.lora
    return svc.create_lora_training_client(
        cfg.model.base_model,
        rank=lora.rank,
        alpha=lora.alpha,
        training_session_name=name,
        seed=int(cfg.seed),
        train_attn=lora.train_attn,
        train_mlp=lora.train_mlp,
        train_unembed=lora.train_unembed,
        user_metadata={"run_dir": str(record.path)},
    )


def _execute(cfg, record: RunRecord, *, start_step, resume_from, on_step, show_progress) -> None:
    from .progress import Progress

    module = LOOPS[cfg.loop.name]
    data = datasets.load(cfg.data, int(cfg.seed), shuffle=bool(cfg.loop.get("shuffle", True)))
    for shape in getattr(module, "NEEDS", ()):
        data.need(shape, cfg.loop.name)
    logger = Logger(record, cfg.logger, OmegaConf.to_container(cfg, resolve=True))
    svc = service_client(cfg.engine)
    tc = None
    status = "failed"
    try:
        tc = _open_session(svc, cfg, record, resume_from)
        record.update_meta(session=tc.name, engine={"kind": cfg.engine.kind, "url": svc.url})
        run = Run(
            cfg, svc, tc, tc.get_tokenizer(), data, record, logger, start_step=start_step, on_step=on_step
        )
        with Progress(cfg, start_step, enabled=show_progress) as progress:
            run.progress = progress
            if start_step == 0:
                run.evaluate(0)
            if start_step < cfg.loop.steps:
                module.main(run)
            final = cfg.loop.steps
            run.evaluate(final)
            if run._last_saved != final:
                run.save(final)
        path = tc.save_weights_for_sampler(name="final").result().path
        record.append("checkpoints.jsonl", {"step": cfg.loop.steps, "kind": "sampler", "path": path})
        status = "completed"
    except (KeyboardInterrupt, RunInterrupted):
        status = "interrupted"
        raise
    finally:
        logger.close()
        if tc is not None:
            try:
                record.write_usage(svc.get_usage(tc.name).to_wire())
            except Exception:  # usage is a record, not a reason to hide the run's own error
                pass
            if not cfg.keep_session and status != "interrupted":
                try:
                    tc.stop()
                except Exception:
                    pass
        record.update_meta(status=status, finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if cfg.engine.kind != "inprocess":
            svc.close()
