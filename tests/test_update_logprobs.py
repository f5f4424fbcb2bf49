"""The chunked log-probability path of trainer/update.py against the plain one (full logits, then
log-softmax): same log-probs and same gradients on small random models, whatever the chunking."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_harness.trainer import update as U

VOCAB = 1000


def qwen2(tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=2, intermediate_size=128, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def samples(seed: int = 0, n: int = 4) -> list[U.Sample]:
    """Prompts and responses of different lengths (so the batch has padding), masks with 0 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        resp = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 17))]
        mask = [1 if rng.random() < 0.7 else 0 for _ in resp]
        out.append(U.Sample(f"r{i}~0", prompt, resp, mask, [-1.0] * len(resp), rng.choice([-1.0, 1.0]), 0.1))
    return out


def logprobs_and_grads(model, batch, temperature=1.0, chunk=0):
    """Log-probs [B, R] and the gradient of a weighted sum of them, flattened over all parameters."""
    model.zero_grad(set_to_none=True)
    lp = U.response_logprobs(model, batch, temperature, chunk)
    weights = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape) * batch.valid
    (lp * weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return lp.detach(), grads


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_path(tie, temperature):
    model = qwen2(tie=tie)
    batch = U.collate(samples(seed=1), torch.device("cpu"))
    ref_lp, ref_g = logprobs_and_grads(model, batch, temperature, chunk=0)
    assert ref_g.abs().max() > 1e-4  # a real gradient
    assert (ref_lp[batch.valid] < 0).all() and (ref_lp[~batch.valid] == 0).all()
    for chunk in (1, 7, 10_000):  # one row per chunk, a size that divides nothing, one chunk for all
        lp, g = logprobs_and_grads(model, batch, temperature, chunk=chunk)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, ref_g, atol=grad_atol(ref_g), rtol=1e-4)


def grad_atol(ref_g: torch.Tensor) -> float:
    """fp32 summation order alone moves a gradient element by ~1e-6 of the largest one (measured: up
    to 9e-7 of it between chunkings): a fixed 1e-6 failed for small elements of a gradient whose
    largest is ~10, deterministically on a rebuilt machine where the same code had passed before."""
    return 2e-6 * float(ref_g.abs().max())


def test_chunked_path_with_body_checkpointing_and_without_grad():
    model = qwen2(seed=2)
    batch = U.collate(samples(seed=2, n=3), torch.device("cpu"))
    ref_lp, ref_g = logprobs_and_grads(model, batch, chunk=0)
    model.gradient_checkpointing_enable()
    lp, g = logprobs_and_grads(model, batch, chunk=5)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, ref_g, atol=grad_atol(ref_g), rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(U.response_logprobs(model, batch, 1.0, 5), ref_lp, atol=1e-5, rtol=1e-5)


def test_a_soft_capped_head_falls_back_to_full_logits():
    """Gemma2 caps its logits after the head: the chunked path must not skip that."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(3)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       num_hidden_layers=1, intermediate_size=128, final_logit_softcapping=2.0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    assert not U._plain_lm_head(model) and U._plain_lm_head(qwen2())
    batch = U.collate(samples(seed=3, n=2), torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(U.response_logprobs(model, batch, 1.0, 4),
                                   U.full_logits_logprobs(model, batch), atol=1e-5, rtol=1e-5)


def test_updater_gradients_do_not_depend_on_logprob_chunking(tmp_path):
    """The whole micro-batch step (loss, aggregation, backward) through PolicyUpdater, both paths."""
    rows = samples(seed=4, n=6)
    results = []
    for chunk in (0, 3):
        cfg = U.UpdateConfig(micro_batch_size=4, logprob_chunk_tokens=chunk, device="cpu")
        up = U.PolicyUpdater(tmp_path, cfg, model=qwen2(seed=4))
        up.optimizer.zero_grad(set_to_none=True)
        stats = up.accumulate_gradients(rows)
        results.append((torch.cat([p.grad.flatten() for p in up.model.parameters()]), stats))
    (g_full, s_full), (g_chunk, s_chunk) = results
    assert g_full.abs().max() > 1e-4
    torch.testing.assert_close(g_chunk, g_full, atol=1e-6, rtol=1e-4)
    assert s_chunk["loss"] == pytest.approx(s_full["loss"], rel=1e-4, abs=1e-7)


def test_autocast_switch(tmp_path):
    """'auto' leaves CPU in fp32; 'bfloat16' runs the matmuls in bf16 (close, not equal); a typo fails."""
    rows = samples(seed=5, n=2)
    batch = U.collate(rows, torch.device("cpu"))
    model = qwen2(seed=5)
    fp32 = U.PolicyUpdater(tmp_path, U.UpdateConfig(device="cpu"), model=model)
    bf16 = U.PolicyUpdater(tmp_path, U.UpdateConfig(device="cpu", autocast="bfloat16"), model=model)
    assert not fp32.autocast and bf16.autocast
    with torch.no_grad():
        ref = U.full_logits_logprobs(model, batch)
        torch.testing.assert_close(fp32.logprobs(model, batch), ref, atol=1e-5, rtol=1e-5)
        low = bf16.logprobs(model, batch)
    assert low.dtype == torch.float32
    assert not torch.equal(low, ref) and (low - ref).abs().max() < 0.2
    with pytest.raises(ValueError, match="autocast"):
        U.UpdateConfig.from_dict({"autocast": "fp8"})
