"""Every command in README.md and docs/ runs as written for the models it names.

The fenced ``bash`` blocks of each page are read in order, as a user would type them, in one
working folder where each model the pages name is a folder holding its real configuration
(``tests/readme_models``) and its family's real tokenizer (no weights), and the data files they
name are small real texts. What fits this machine runs (projection, alignment); what needs GPU
nodes or the models' weights is dry-run: ``pretrain_xdistill.py --dry-run`` (every input
checked against the real shapes: heads and query groups against TP, vocabularies, the projection
the page built, the data), ``xdistill-convert ... --dry-run``. A converted checkpoint or a run
a command would write is stood in for by its model description, so the next command finds it.
Commands of launchers and tools whose runs take whole models (``xdistill-evaluate``,
``xdistill-ray``) are parsed with their own parsers; a fragment (``...``) must use known flags.
Scripts of the repository (``python benchmarks/bench_loss.py ...``, ``python tools/...``,
``python -m megatron_xdistill.demo ...``, ``bash benchmarks/device/checks.sh``) must exist, and
every flag a command gives must be one the script's argparse defines (read from its source).
YAML blocks whose first line names a file (``# run.yaml``) are written to that file.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from shared_assets import ASSETS, TOKENIZERS, needs_shared_assets

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
MODELS = Path(__file__).resolve().parent / "readme_models"
#: The models the pages name -> their family's tokenizer in the shared assets.
#: Phi-4-mini's own (o200k) tokenizer is not in the assets: GPT-2's byte-level BPE stands in,
#: grown to Phi-4-mini's tokenizer size with reserved tokens (the commands check shapes and the
#: projection's form, not the vocabulary's contents).
TOKENIZER_OF = {"SmolLM2-135M": "smollm2", "Qwen2.5-Coder-1.5B": "qwen2",
                "Llama-3.2-1B": "llama3", "Llama-3.2-3B": "llama3", "Qwen3-4B": "qwen2",
                "Phi-4-mini-instruct": "gpt2", "Qwen3-30B-A3B": "qwen2"}
#: Commands that are the project's own entry points elsewhere checked (CI runs `make test`;
#: `make demo` is the demo) or installation steps (`make install` is what CI runs).
NOT_RUN = ("make", "pip", "python3 -m venv", ".", "cd", "git")

pytestmark = needs_shared_assets


def fenced_blocks(page: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block, in page order."""
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"^```(\w*)\n(.*?)^```", page.read_text(), re.M | re.S)]


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def _as_llama32(path: Path) -> None:
    """The assets' Llama 3 tokenizer with Llama 3.2's 128,256 tokens: it carries one added token
    more (``<|endoftext|>``, id 128256) that Llama 3.2's own has not."""
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < 128256]
    path.write_text(json.dumps(data))


#: Phi-4-mini-instruct's tokenizer size (o200k plus its chat tokens; the model has 200,064 rows).
PHI4MINI_TOKENS = 200029


def _reserve_up_to(path: Path, size: int) -> None:
    """A stand-in tokenizer grown to ``size`` tokens with reserved special tokens (never produced
    by encoding text), so the vocabulary checks see the real model's tokenizer size."""
    data = json.loads(path.read_text())
    first = 1 + max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])])
    data["added_tokens"] += [{"id": i, "content": f"<|reserved_{i}|>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True} for i in range(first, size)]
    path.write_text(json.dumps(data))


def _value(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def _describe(hf_dir: Path, out: Path) -> None:
    """The description of the checkpoint that converting ``hf_dir`` would write at ``out``."""
    from megatron_xdistill.models.description import save_model_info
    from megatron_xdistill.models.hf_config import model_info_from_hf

    save_model_info(model_info_from_hf(str(hf_dir)), str(out))


class Workspace:
    """The folder the pages' commands run in: their models (configuration + tokenizer) and
    data files (real text)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name, tokenizer in TOKENIZER_OF.items():
            shutil.copytree(TOKENIZERS / tokenizer, root / name)
            shutil.copy(MODELS / name / "config.json", root / name / "config.json")
            if tokenizer == "llama3":
                _as_llama32(root / name / "tokenizer.json")
            if name == "Phi-4-mini-instruct":
                _reserve_up_to(root / name / "tokenizer.json", PHI4MINI_TOKENS)
        texts = [json.loads(x)["text"] for x in
                 (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:6]]
        # The pages' commands run from the repository root: its example configs are there.
        (root / "examples").symlink_to(REPO / "examples")
        for name in ("code.jsonl", "held_out.jsonl", "train.jsonl"):
            (root / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        (root / "prompts.jsonl").write_text(json.dumps({"prompt": "2 + 3 =", "answer": "5"})
                                            + "\n")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), root / "web.parquet")

    @classmethod
    def existing(cls, root: Path) -> Workspace:
        """A workspace a page's commands already ran in (the README's, copied)."""
        space = cls.__new__(cls)
        space.root = root
        return space

    def run(self, words: list[str], where: str) -> None:
        """One command as the page gives it (see the module docstring)."""
        if "..." in words:
            return self._fragment(words, where)
        program = words[0]
        if "-m" in words and words[words.index("-m") + 1:][:1] == [
                "megatron_xdistill.evaluation.lm_eval_cli"]:  # xdistill-lm-eval under torchrun
            return self._lm_eval(words[words.index("-m") + 2:], where)
        if program == "torchrun" or (program.startswith("python") and any(
                w.endswith("pretrain_xdistill.py") for w in words)):
            at = next(i for i, w in enumerate(words) if w.endswith("pretrain_xdistill.py"))
            world = int(_value(words, "--nproc-per-node") or _value(words, "--nproc_per_node")
                        or 1)
            return self._pretrain(words[at + 1:], world, where)
        if program == "xdistill-convert":
            return self._convert(words[1:], where)
        if program in ("xdistill-projection", "xdistill-align"):
            module = {"xdistill-projection": "megatron_xdistill.projection.cli",
                      "xdistill-align": "megatron_xdistill.align.cli"}[program]
            import importlib

            assert importlib.import_module(module).main(words[1:]) == 0, where
            return None
        if program in ("xdistill-evaluate", "xdistill-ray"):
            return self._parse_only(program, words[1:], where)
        if program == "xdistill-lm-eval":
            return self._lm_eval(words[1:], where)
        if any(" ".join(words).startswith(p) for p in NOT_RUN):
            return None
        if program.startswith("python") or program == "bash":
            return self._script(words, where)
        raise AssertionError(f"{where}: no way to check `{' '.join(words)}`: teach "
                             f"tests/test_readme_commands.py its program")

    def _pretrain(self, argv: list[str], world: int, where: str) -> None:
        from megatron_xdistill.training.run import main

        os.environ["WORLD_SIZE"] = str(world)
        try:
            assert main([*argv, "--dry-run"]) == 0, f"{where}: pretrain_xdistill.py refused it"
        finally:
            os.environ.pop("WORLD_SIZE", None)
        save, load = _value(argv, "--save"), _value(argv, "--load")
        if save and load:  # the run this command would make, as a later command reads it
            (self.root / save).mkdir(parents=True, exist_ok=True)
            shutil.copy(self.root / load / "xdistill_model.json", self.root / save)

    def _convert(self, argv: list[str], where: str) -> None:
        from conversion.cli import main

        assert main([*argv, "--dry-run"]) == 0, f"{where}: xdistill-convert refused it"
        if argv[0] == "hf-to-mcore":
            _describe(self.root / _value(argv, "--hf-dir"), self.root / _value(argv, "--out"))

    def _parse_only(self, program: str, argv: list[str], where: str) -> None:
        if program == "xdistill-evaluate":
            from megatron_xdistill.evaluation.bits_per_byte import _parser
        else:
            from megatron_xdistill.launch.cli import build_parser as _parser
        head = argv[: argv.index("--")] if "--" in argv else argv
        _parser().parse_args(head)  # exits (fails the test) on an unknown or bad flag
        if "--" in argv:
            self._fragment(argv[argv.index("--") + 1:], where)

    @staticmethod
    def _lm_eval(argv: list[str], where: str) -> None:
        """lm-eval's own parser takes the arguments (exits, failing the test, on a bad one) and
        the model is this project's backend."""
        from lm_eval.__main__ import HarnessCLI

        saved = sys.argv
        sys.argv = ["xdistill-lm-eval", *argv]
        try:
            args = HarnessCLI().parse_args()
        finally:
            sys.argv = saved
        assert args.model == "xdistill", f"{where}: xdistill-lm-eval with --model {args.model}"

    def _script(self, words: list[str], where: str) -> None:
        """A script of the repository: it exists, and it defines every flag given."""
        if words[1] == "-m":
            spec = importlib.util.find_spec(words[2])
            assert spec is not None and spec.origin, f"{where}: no module {words[2]}"
            origin = Path(spec.origin)
            sources = sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" \
                else [origin]
            flags = words[3:]
        else:
            script = REPO / words[1]
            assert script.is_file(), f"{where}: {words[1]} is not a file of the repository"
            sources, flags = [script], words[2:]
        if words[0] == "bash":
            return
        known = {value for source in sources for value in _argparse_flags(source)}
        unknown = [w for w in flags if w.startswith("--") and w.split("=")[0] not in known]
        assert not unknown, f"{where}: {' '.join(words[:3])} defines no {unknown}"

    def _fragment(self, words: list[str], where: str) -> None:
        from megatron_xdistill.training.arguments import build_parser

        known = {o for a in build_parser()._actions for o in a.option_strings}
        unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in known
                   and w != "--nproc-per-node"]
        assert not unknown, f"{where}: unknown flags {unknown}"


def _argparse_flags(source: Path) -> set[str]:
    """The option strings a script's ``add_argument`` calls define."""
    tree = ast.parse(source.read_text())
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant)
            and isinstance(arg.value, str) and arg.value.startswith("-")}


def run_page(page: Path, root: Path) -> int:
    """Every command of ``page`` in order, in the workspace ``root`` (the current folder);
    the number of commands run."""
    space = Workspace.existing(root) if (root / "code.jsonl").exists() else Workspace(root)
    ran = 0
    for number, (language, text) in enumerate(fenced_blocks(page), 1):
        where = f"{page.name}, code block {number}"
        first = text.splitlines()[0] if text.strip() else ""
        if language == "yaml" and re.match(r"#\s*[\w.-]+\.ya?ml\s*$", first):
            (root / first.lstrip("# ").strip()).write_text(text)
        elif language in ("bash", "sh", "shell"):
            for words in shell_commands(text):
                space.run(words, where)
                ran += 1
    return ran


@pytest.fixture(scope="module")
def after_readme(tmp_path_factory):
    """The README's run done (its checkpoints' descriptions, the projection): the docs pages
    continue from it, as a reader who followed the README does."""
    root = tmp_path_factory.mktemp("readme")
    here = os.getcwd()
    os.chdir(root)
    try:
        ran = run_page(REPO / "README.md", root)
    finally:
        os.chdir(here)
    return root, ran


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_command_runs_as_written(page, after_readme, tmp_path, monkeypatch):
    root, readme_ran = after_readme
    if page.name == "README.md" and page.parent == REPO:
        assert readme_ran, "README.md shows no command"
        return
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    run_page(page, tmp_path)
