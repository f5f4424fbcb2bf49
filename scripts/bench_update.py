"""Benchmark: one policy update of a Qwen2-shaped model with random weights, full-logits log-probs
(``logprob_chunk_tokens: 0``, the old path) against the chunked path, in the same run.

The model is built from a local ``Qwen2Config`` (no hub, no download). Per path it measures the peak
memory of the log-probability step (``PolicyUpdater.accumulate_gradients``: log-probs, loss,
backward) and times one whole update (``PolicyUpdater.update``, AdamW step included; lr 0 so every
path sees the same weights and must report the same loss and gradient norm).

    .venv/bin/python scripts/bench_update.py --quick    # CPU, 150k vocabulary, < 1 min
    python scripts/bench_update.py --gpu                # CUDA, Qwen2-1.5B shape, 8k and 32k tokens

CPU: each path runs in its own process; peak = growth of the resident set during the step (Linux
VmHWM after a reset through /proc/self/clear_refs). GPU: ``torch.cuda.max_memory_allocated``; fp32
weights with bf16 autocast and activation checkpointing of the body; MFU against an assumed
H200 bf16 dense peak of 989 TFLOP/s, counting 6 x (matmul parameters) per token, the LM head on
response tokens only, and causal attention (6 x layers x hidden x tokens^2), recomputation not counted.
``--gpu`` runs from the repository root with only torch, transformers, numpy and pyarrow: the update
code is loaded by path, not from an installed package.

Target (issue 12): log-prob step peak memory at a 150k vocabulary cut >= 4x at equal numbers.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.util
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_DENSE_FLOPS = 989e12
QUICK = {"vocab": 151936, "hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 256}
QWEN2_1_5B = {"vocab": 151936, "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960}


@functools.cache
def load_update_module():
    """``trainer/update.py`` of this checkout as ``lightning_harness.trainer.update``, whether or not
    the package is installed (its imports: torch, pyarrow, numpy, yaml; click only if present)."""
    for name, init in (("lightning_harness", ROOT / "lightning_harness"),
                       ("lightning_harness.trainer", ROOT / "trainer")):
        spec = importlib.util.spec_from_file_location(name, init / "__init__.py",
                                                      submodule_search_locations=[str(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module("lightning_harness.trainer.update")


def build_model(shape: dict, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      intermediate_size=shape["intermediate"], max_position_embeddings=40960,
                      tie_word_embeddings=False)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).float().train()


def make_samples(U, n: int, tokens: int, vocab: int) -> list:
    """``n`` samples of ``tokens`` tokens each: 1/8 prompt, 7/8 response (70% model tokens)."""
    rng = random.Random(0)
    prompt_len = max(1, tokens // 8)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        resp = [rng.randrange(vocab) for _ in range(tokens - prompt_len)]
        mask = [1] + [int(rng.random() < 0.7) for _ in resp[1:]]
        rows.append(U.Sample(f"r{i}~0", prompt, resp, mask, [-2.0] * len(resp), 1.0, 1.0 / sum(mask)))
    return rows


class PeakMemory:
    """Peak bytes allocated during a ``with`` block above what was allocated before it."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self._status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.absolute = torch.cuda.max_memory_allocated()
        else:
            self.absolute = self._status("VmHWM")
        self.peak = self.absolute - self.base

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {key} in /proc/self/status")


def run_path(U, model, rows, chunk: int, device: str, body_checkpointing: bool) -> dict:
    """Peak memory of the log-prob step, then the time of one whole update, for one path."""
    cfg = U.UpdateConfig(lr=0.0, device=device, logprob_chunk_tokens=chunk, micro_batch_size=len(rows),
                         gradient_checkpointing=body_checkpointing, max_seq_len=1 << 20)
    up = U.PolicyUpdater(ROOT / "random-weights", cfg, model=model)
    with PeakMemory(device) as mem:
        up.accumulate_gradients(rows)
    up.optimizer.zero_grad(set_to_none=True)
    with PeakMemory(device) as whole:  # the update, AdamW's moments included
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = up.update(rows)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return {"peak": mem.peak, "absolute": mem.absolute, "update_max": whole.absolute, "update_s": seconds,
            "cpu_s": cpu_seconds, "loss": metrics["update/loss"], "grad_norm": metrics["update/grad_norm"]}


def model_flops(model, rows) -> float:
    """Training FLOPs of one update (see the module docstring for what is counted)."""
    cfg, body = model.config, model.base_model
    matmul = sum(p.numel() for n, p in body.named_parameters() if "layers." in n and p.dim() == 2)
    total = 0.0
    for s in rows:
        t = len(s.prompt) + len(s.response)
        total += 6 * matmul * t + 6 * cfg.hidden_size * cfg.vocab_size * len(s.response)
        total += 6 * cfg.num_hidden_layers * cfg.hidden_size * t * t
    return total


# -- CPU: one process per path so one path's freed memory cannot hide the other's peak ------------
def child(args) -> None:
    U = load_update_module()
    model = build_model(QUICK, "cpu")
    rows = make_samples(U, args.samples, args.tokens, QUICK["vocab"])
    print(json.dumps(run_path(U, model, rows, args.chunk if args.child == "new" else 0, "cpu", False)))


def quick(args) -> None:
    results = {}
    for path in ("old", "new"):
        cmd = [sys.executable, __file__, "--child", path, "--tokens", str(args.tokens),
               "--samples", str(args.samples), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{path} path failed:\n{out.stderr}")
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = args.samples * args.tokens
    print(f"CPU, Qwen2 shape {QUICK}, {args.samples} x {args.tokens} tokens (1/8 prompt), "
          f"chunk {args.chunk}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'path':<18}{'logprob-step peak':>18}{'update s':>10}{'CPU s':>7}{'tokens/s':>10}"
          f"{'loss':>14}{'grad_norm':>14}")
    for path, r in results.items():
        name = "old (full logits)" if path == "old" else "new (chunked)"
        print(f"{name:<18}{r['peak'] / 2**20:>15.0f} MiB{r['update_s']:>10.2f}{r['cpu_s']:>7.1f}"
              f"{tokens / r['update_s']:>10.0f}"
              f"{r['loss']:>14.6g}{r['grad_norm']:>14.6g}")
    old, new = results["old"], results["new"]
    print(f"peak memory old/new: {old['peak'] / max(new['peak'], 1):.1f}x (target >= 4x); "
          f"loss rel. diff {abs(old['loss'] - new['loss']) / max(abs(old['loss']), 1e-12):.1e}, "
          f"grad_norm rel. diff {abs(old['grad_norm'] - new['grad_norm']) / max(old['grad_norm'], 1e-12):.1e}")


# -- GPU: one process, one model, OOM reported instead of raised ----------------------------------
def gpu(args, device: str = "cuda", shape: dict = QWEN2_1_5B) -> None:
    """``--gpu``; ``--gpu-dry-run`` runs the same code on CPU at the quick shape (checks the script)."""
    U, t_start = load_update_module(), time.perf_counter()
    model = build_model(shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else "none (dry run on CPU)"
    print(f"GPU {name}, torch {torch.__version__}, Qwen2 shape {shape} ({n_params / 1e9:.2f}B parameters, "
          f"built in {time.perf_counter() - t_start:.0f}s), "
          f"fp32 weights{' + bf16 autocast' if device == 'cuda' else ''}, body checkpointing, chunk {args.chunk}; "
          f"MFU vs {H200_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s (H200 bf16 dense)\n"
          f"{'tokens':>7} {'path':<18}{'logprob-step peak':>18}{'max alloc':>10}{'update max alloc':>17}"
          f"{'update s':>9}{'tokens/s':>10}{'MFU':>7}{'loss':>12}", flush=True)
    for tokens in args.gpu_tokens:
        rows = make_samples(U, 1, tokens, shape["vocab"])
        peaks = {}
        for path, chunk in (("new (chunked)", args.chunk), ("old (full logits)", 0)):
            if time.perf_counter() - t_start > args.budget_s:
                print(f"{tokens:>7} {path:<18}{'skipped (time budget)':>24}", flush=True)
                continue
            r = run_or_oom(U, model, rows, chunk, device)
            if r is None:
                print(f"{tokens:>7} {path:<18}{'OOM':>18}", flush=True)
                continue
            peaks[path] = r["peak"]
            mfu = model_flops(model, rows) / r["update_s"] / H200_BF16_DENSE_FLOPS
            print(f"{tokens:>7} {path:<18}{r['peak'] / 2**30:>14.1f} GiB{r['absolute'] / 2**30:>6.1f} GiB"
                  f"{r['update_max'] / 2**30:>13.1f} GiB{r['update_s']:>9.2f}{tokens / r['update_s']:>10.0f}"
                  f"{mfu:>7.1%}{r['loss']:>12.5g}", flush=True)
        if len(peaks) == 2:
            print(f"{tokens:>7} peak memory old/new: {peaks['old (full logits)'] / peaks['new (chunked)']:.1f}x",
                  flush=True)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)


def run_or_oom(U, model, rows, chunk: int, device: str) -> dict | None:
    """run_path, or None when the device ran out of memory (then everything it held is freed)."""
    try:
        result = run_path(U, model, rows, chunk, device, True)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if "out of memory" not in str(exc).lower():
            raise
        result = None
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="CPU, small body, 150k vocabulary (< 1 min)")
    mode.add_argument("--gpu", action="store_true", help="CUDA, Qwen2-1.5B shape, 8k and 32k tokens")
    mode.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    mode.add_argument("--gpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024, help="CPU: tokens per sample (default 1024)")
    ap.add_argument("--samples", type=int, default=1, help="CPU: samples per update (default 1)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="logprob_chunk_tokens of the new path (default: 128 on CPU, the config default on GPU)")
    ap.add_argument("--gpu-tokens", type=int, nargs="+", default=[8192, 32768], help="GPU: sample lengths")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="GPU: start no further run after this many seconds (default 330)")
    args = ap.parse_args()
    if args.chunk is None:
        args.chunk = load_update_module().UpdateConfig().logprob_chunk_tokens if args.gpu else 128
    if args.child:
        child(args)
    elif args.quick:
        quick(args)
    elif args.gpu_dry_run:
        gpu(args, "cpu", QUICK)
    else:
        gpu(args)


if __name__ == "__main__":
    main()
