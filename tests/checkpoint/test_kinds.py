"""What a folder is: one function answers (flaxheads.checkpoint.kinds.folder_kind), and every reader
(fh.load, flaxheads export, flaxheads.interop.import_model, flaxheads checkpoints) asks it."""

from __future__ import annotations

import ast
import inspect

import pytest

from flaxheads.checkpoint.kinds import FolderKind, folder_kind


def _folder(tmp_path, *files: str, dirs: tuple[str, ...] = ()):
    for d in dirs:
        (tmp_path / d).mkdir(parents=True)
    for f in files:
        (tmp_path / f).write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    "files, dirs, kind",
    [
        (("config.json", "model.safetensors"), (), FolderKind.TRANSFORMERS),
        (("config.json", "pytorch_model.bin"), (), FolderKind.TRANSFORMERS),
        (("modules.json", "config.json", "model.safetensors"), ("1_Pooling",), FolderKind.SENTENCE_TRANSFORMERS),
        (("adapter_config.json", "adapter_model.safetensors"), (), FolderKind.PEFT_ADAPTER),
        (("head_config.json", "head.safetensors"), (), FolderKind.HEAD_EXPORT),
        (("model.onnx", "config.json", "tokenizer.json"), (), FolderKind.ONNX),
        # weights beside model.onnx: a transformers folder that also has an ONNX file
        (("model.onnx", "config.json", "model.safetensors"), (), FolderKind.TRANSFORMERS),
        # a run folder: its config.json is the run's, not a model's
        (("config.json", "metrics.jsonl"), ("checkpoints/3/meta",), FolderKind.RUN),
        (("config.json", "metrics.jsonl"), (), FolderKind.RUN),  # a run that saved no checkpoint
        ((), ("3/meta", "5/meta"), FolderKind.RUN),  # a checkpoint root
        (("tokenizer.json",), (), None),
        ((), (), None),
    ],
)
def test_folder_kind(tmp_path, files, dirs, kind):
    assert folder_kind(_folder(tmp_path, *files, dirs=dirs)) is kind


def test_a_step_folder_is_a_run(tmp_path):
    _folder(tmp_path, dirs=("run/checkpoints/7/meta",))
    assert folder_kind(tmp_path / "run" / "checkpoints" / "7") is FolderKind.RUN
    assert folder_kind(str(tmp_path / "run" / "checkpoints")) is FolderKind.RUN


def test_a_file_or_nothing_is_no_kind(tmp_path):
    (tmp_path / "model.safetensors").write_text("")
    assert folder_kind(tmp_path / "model.safetensors") is None
    assert folder_kind(tmp_path / "missing") is None


def test_a_kind_is_its_short_name_and_says_what_it_is():
    assert FolderKind.HEAD_EXPORT == "head export" and f"{FolderKind.PEFT_ADAPTER}" == "PEFT adapter"
    assert FolderKind.TRANSFORMERS.described == "a transformers model folder"
    assert all(k.described for k in FolderKind)


def _code_names(module) -> set[str]:
    """The names and string constants a module's code uses (docstrings left out)."""
    tree = ast.parse(inspect.getsource(module))
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.add(n.value)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name)
    return out


def test_the_readers_ask_it():
    """No reader tells a format by its files itself: formats, interop and the checkpoint listing ask folder_kind."""
    import flaxheads.checkpoint.inspect as listing
    import flaxheads.formats as formats
    import flaxheads.formats.sources as sources
    import flaxheads.interop as interop
    import flaxheads.interop.transformers as transformers

    own = (
        "adapter_config.json",
        "head_config.json",
        "modules.json",
        "model.onnx",
        "metrics.jsonl",
        "HEAD_CONFIG",
        "ADAPTER_CONFIG",
        "ONNX_FILE",
        "is_checkpoint_folder",
        "is_adapter_folder",
    )
    for module in (formats, sources, interop, transformers, listing):
        names = _code_names(module)
        assert "folder_kind" in names, module.__name__
        assert not names & set(own), f"{module.__name__} tells a folder by {sorted(names & set(own))} itself"
