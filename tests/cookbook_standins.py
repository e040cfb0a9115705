"""Small local stand-ins for the hub datasets tinker-cookbook's recipes load, in the hub's own format.

``datasets.load_dataset("org/name", name=CONFIG, split=SPLIT)`` run in a directory that holds
``./org/name`` loads that directory: its README's ``configs:`` YAML names each config's splits and
their files (JSON lines, the columns the real dataset has). A recipe run with that directory as its
working directory reads these files instead of the hub, unmodified. The rows are few and short (a
recipe step here is seconds, not hours); GSM8K's rows are real ones (/work/shared/data/gsm8k)."""

from __future__ import annotations

import json
from pathlib import Path

GSM8K = Path("/work/shared/data/gsm8k")

# (problem, stdin tests as (input, output), a correct solution): the code_rl stand-in and its SFT
CODE_TASKS = [
    (
        "Read two integers a and b on one line and print their sum.",
        [("1 2\n", "3\n"), ("10 -4\n", "6\n")],
        "a, b = map(int, input().split())\nprint(a + b)",
    ),
    (
        "Read two integers a and b on one line and print their product.",
        [("3 4\n", "12\n"), ("-2 5\n", "-10\n")],
        "a, b = map(int, input().split())\nprint(a * b)",
    ),
    (
        "Read one line of text and print it reversed.",
        [("abc\n", "cba\n"), ("hello\n", "olleh\n")],
        "print(input()[::-1])",
    ),
    (
        "Read integers on one line and print the largest.",
        [("1 5 3\n", "5\n"), ("-1 -7\n", "-1\n")],
        "print(max(map(int, input().split())))",
    ),
    (
        "Read an integer n and print n squared.",
        [("3\n", "9\n"), ("-4\n", "16\n")],
        "n = int(input())\nprint(n * n)",
    ),
    (
        "Read a word and print it in upper case.",
        [("abc\n", "ABC\n"), ("Hi\n", "HI\n")],
        "print(input().upper())",
    ),
    (
        "Read integers on one line and print their sum.",
        [("1 2 3\n", "6\n"), ("5\n", "5\n")],
        "print(sum(map(int, input().split())))",
    ),
    (
        "Read an integer n and print YES if it is even, else NO.",
        [("4\n", "YES\n"), ("7\n", "NO\n")],
        "print('YES' if int(input()) % 2 == 0 else 'NO')",
    ),
]
# tasks the code SFT does not teach, in the RL split only: near-copies of taught ones with other
# answers, so a short SFT's model fails some of them and the grader is seen saying no too
UNTAUGHT_CODE_TASKS = [
    ("Read two integers a and b on one line and print a minus b.", [("5 2\n", "3\n"), ("1 4\n", "-3\n")], ""),
    ("Read an integer n and print n cubed.", [("2\n", "8\n"), ("-3\n", "-27\n")], ""),
    ("Read one line of text and print its length.", [("abc\n", "3\n"), ("hello\n", "5\n")], ""),
    ("Read integers on one line and print the smallest.", [("1 5 3\n", "1\n"), ("-1 -7\n", "-7\n")], ""),
]


def write_dataset(root: Path, repo: str, configs: dict[str, dict[str, list[dict]]]) -> Path:
    """``root/repo`` as a hub dataset: per config and split a JSON-lines file, and the README's
    ``configs:`` YAML naming them (the first config is the default)."""
    directory = root / repo
    lines = ["---", "configs:"]
    for index, (config, splits) in enumerate(configs.items()):
        lines.append(f"- config_name: {config}")
        if index == 0:
            lines.append("  default: true")
        lines.append("  data_files:")
        for split, rows in splits.items():
            path = directory / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            lines += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    lines += ["---", "", f"A local stand-in for {repo}.", ""]
    (directory / "README.md").write_text("\n".join(lines))
    return directory


def _gsm8k(split: str, n: int) -> list[dict]:
    rows = (GSM8K / f"{split}.jsonl").read_text().splitlines()[:n]
    return [json.loads(row) for row in rows]


def _hh(n: int) -> list[dict]:
    pairs = [
        ("What is the capital of France?", "The capital of France is Paris.", "I don't know."),
        ("How many legs does a spider have?", "A spider has eight legs.", "Spiders have legs."),
        ("Say hello politely.", "Hello! How can I help you today?", "What."),
        ("What color is the sky on a clear day?", "It is blue.", "Go away."),
    ]
    return [
        {
            "chosen": f"\n\nHuman: {q}\n\nAssistant: {good}",
            "rejected": f"\n\nHuman: {q}\n\nAssistant: {bad}",
        }
        for q, good, bad in (pairs * n)[:n]
    ]


def _deepcoder(tasks: list[tuple]) -> list[dict]:
    return [
        {
            "problem": problem,
            "tests": json.dumps([{"input": i, "output": o, "testtype": "stdin_stdout"} for i, o in tests]),
            "metadata": "{}",
            "starter_code": "",
        }
        for problem, tests, _ in tasks
    ]


# SciKnowEval's multiple-choice rows (the SDFT recipe keeps domain Chemistry, level L3, "mcq" types)
SCIENCE_MCQ = [
    (
        "Which gas do plants take in for photosynthesis?",
        ["Oxygen", "Carbon dioxide", "Nitrogen", "Helium"],
        "B",
    ),
    ("What is the chemical symbol of sodium?", ["Na", "S", "So", "N"], "A"),
    ("What is the pH of pure water at 25 C?", ["1", "5", "7", "14"], "C"),
    ("Which element has atomic number 1?", ["Helium", "Carbon", "Oxygen", "Hydrogen"], "D"),
    ("What is the formula of table salt?", ["KCl", "NaCl", "CaCO3", "H2O"], "B"),
    ("Which of these is a noble gas?", ["Argon", "Chlorine", "Sodium", "Iron"], "A"),
    ("What does an acid release in water?", ["OH- ions", "Electrons", "H+ ions", "Neutrons"], "C"),
    ("How many atoms are in a water molecule?", ["1", "2", "4", "3"], "D"),
    ("Which bond shares electrons?", ["Ionic", "Covalent", "Metallic", "None"], "B"),
    ("What is the charge of an electron?", ["Negative", "Positive", "Neutral", "Variable"], "A"),
]


def _sciknoweval() -> list[dict]:
    return [
        {
            "question": question,
            "choices": {"label": ["A", "B", "C", "D"], "text": texts},
            "answerKey": key,
            "answer": "",
            "type": "mcq-4-choices",
            "domain": "Chemistry",
            "details": {"level": "L3", "task": "reaction_prediction", "subtask": "", "source": "stand-in"},
        }
        for question, texts, key in SCIENCE_MCQ
    ]


def write_standins(root: Path) -> Path:
    """Every stand-in the recipe suite reads, under ``root`` (the recipes' working directory)."""
    write_dataset(root, "openai/gsm8k", {"main": {"train": _gsm8k("train", 64), "test": _gsm8k("test", 8)}})
    write_dataset(root, "Anthropic/hh-rlhf", {"default": {"train": _hh(16), "test": _hh(4)}})
    questions = [f"What is {a} + {b}? Answer with a number." for a, b in zip(range(3, 19), range(5, 21))]
    write_dataset(root, "zwhe99/DeepMath-103K", {"default": {"train": [{"question": q} for q in questions]}})
    coder = {
        name: {"train": _deepcoder(CODE_TASKS + UNTAUGHT_CODE_TASKS), "test": _deepcoder(CODE_TASKS[:2])}
        for name in ("primeintellect", "taco", "lcbv5", "codeforces")
    }
    write_dataset(root, "agentica-org/DeepCoder-Preview-Dataset", coder)
    write_dataset(root, "hicai-zju/SciKnowEval", {"default": {"test": _sciknoweval()}})
    return root


def code_sft_conversations(path: Path, prompt_of, repeats: int = 4) -> Path:
    """A chat JSON-lines file for the cookbook's ``chat_sl``: each code task as the code recipe asks
    it (``prompt_of(problem)``), answered with its solution in a python code block."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": prompt_of(problem)},
                {"role": "assistant", "content": f"```python\n{solution}\n```"},
            ]
        }
        for problem, _, solution in CODE_TASKS
    ] * repeats
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
