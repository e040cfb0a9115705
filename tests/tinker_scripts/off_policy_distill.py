"""Run under tinker-cookbook's own venv (tests/tinker/test_cookbook_recipes.py): the cookbook's
off-policy distillation loop (``tinker_cookbook.distillation.train_off_policy``, a library loop with
no recipe module of its own), configured as its module docstring shows: an SFT dataset of chats
paired with a teacher, whose top-K prompt logprobs over each chat become (N, K) ``cross_entropy``
targets for the student. Writes the run's metrics rows to ``out``."""

import asyncio
import json
import sys
from pathlib import Path

from tinker_cookbook.distillation.datasets import TeacherConfig
from tinker_cookbook.distillation.train_off_policy import Config, DatasetWithTeacher, main
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

spec = json.loads(sys.argv[1])
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=spec["model_name"],
    renderer_name=spec["renderer_name"],
    max_length=spec["max_length"],
    batch_size=spec["batch_size"],
)
teacher = TeacherConfig(base_model=spec["model_name"], load_checkpoint_path=spec["teacher_checkpoint"])
config = Config(
    learning_rate=spec["learning_rate"],
    dataset_configs=[
        DatasetWithTeacher(
            dataset_builder=FromConversationFileBuilder(file_path=spec["data"], common_config=common),
            teacher_config=teacher,
        )
    ],
    model_name=spec["model_name"],
    recipe_name="off_policy_distillation",
    renderer_name=spec["renderer_name"],
    lora_rank=spec["lora_rank"],
    n_teacher_targets=spec["topk"],
    batch_size=spec["batch_size"],
    save_every=0,
    eval_every=0,
    max_steps=spec["max_steps"],
    log_path=spec["log_path"],
)
asyncio.run(main(config))
rows = Path(spec["log_path"], "metrics.jsonl").read_text().splitlines()
with open(spec["out"], "w") as f:
    json.dump([json.loads(row) for row in rows if row.strip()], f)
