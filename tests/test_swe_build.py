"""scripts/build_swe_model.py's data side, without a model server: the unaddressed edit form keeps
every file state of the solver's episodes (so the observations mini-swe-agent recorded stay true), and
the teacher-forced metric reads the line number and the rest of a fix turn from the right tokens."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples" / "swe"))
import build_swe_model as build  # noqa: E402
import solver  # noqa: E402

TASKS = build.read_tasks("train")


def run_bash(command: str, folder: Path) -> str:
    """The solver's own command (trusted) on a scratch copy; returns the module it leaves."""
    subprocess.run(["bash", "-c", command], cwd=folder, check=True)
    return next(p for p in folder.iterdir() if not p.name.startswith("test_")).read_text()


def solver_episode(task: dict, rng: random.Random) -> tuple[dict, list[str]]:
    """A recorded-style episode: look, a wrong edit (when one exists), the fix, submit; and the
    module's states after each edit."""
    mod = build.module_name(task)
    buggy = task["files"][mod]
    wrong = solver.wrong_edits(task, buggy)
    states = ([rng.choice(wrong)] if wrong else []) + [task["solution"]]
    commands, before = [f"cat -n {mod}"], buggy
    for after in states:
        commands.append(solver.edit_command(mod, before, after))
        before = after
    messages = build.conversation(task, [(c, "exit code 0\n") for c in commands] + [(build.SUBMIT, "")])
    return {"messages": messages, "tools": [build.BASH_TOOL]}, states


def test_unaddressed_rewrite_keeps_every_file_state(tmp_path):
    rng, dropped = random.Random(0), 0
    for i, task in enumerate(TASKS[::9]):
        episode, states = solver_episode(task, rng)
        rewritten = build.unaddress_edits(episode, task)
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / build.module_name(task)).write_text(task["files"][build.module_name(task)])
        commands = [json.loads(c["function"]["arguments"])["command"] for m in rewritten["messages"]
                    for c in m.get("tool_calls") or []]
        edits = [c for c in commands if c.startswith(("sed -i", "python - <<"))]
        assert len(edits) == len(states)
        assert [run_bash(c, folder) for c in edits] == states, edits
        dropped += sum(c.startswith("sed -i 's/") for c in edits)
    assert dropped > 0  # the form is used, not only allowed


def test_edit_command_reaches_the_target_for_several_hunks_near_each_other():
    """The heredoc form's replacements: hunks whose unique blocks overlap become one replacement, and
    an earlier replacement's new text cannot catch a later one's old text (random multi-hunk edits of
    every project's module: changed indentation, dropped and duplicated lines)."""
    rng, checked = random.Random(0), 0
    for _ in range(600):
        source = rng.choice(TASKS)["solution"].splitlines(keepends=True)
        target = list(source)
        for _ in range(rng.randint(2, 4)):
            k, op = rng.randrange(len(target)), rng.random()
            if op < 0.4:
                target[k] = " " + target[k]
            elif op < 0.7:
                del target[k]
            else:
                target.insert(k, rng.choice(source))
        for addressed in (True, False):
            command = solver.edit_command("m.py", "".join(source), "".join(target), addressed)
            after = build.apply_edit("".join(source), command)
            if after is not None:
                assert after == "".join(target), command
                checked += 1
    assert checked > 1000


def test_apply_edit_refuses_what_it_cannot_follow():
    assert build.apply_edit("x = 1\n", "rm -rf /") is None
    assert build.apply_edit("x = 1\n", "sed -i 's/x/y/g' m.py") is None
    assert build.apply_edit("x = 1\ny = 1\n", "sed -i '2s/1/2/' m.py") == "x = 1\ny = 2\n"


@pytest.mark.parametrize("addressed", [True, False])
def test_teacher_forced_segments_find_the_line_number_and_the_edit(addressed):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "examples" / "swe" / "model")
    task = next(t for t in TASKS if solver.edit_command(build.module_name(t), t["files"][build.module_name(t)],
                                                        t["solution"], False).startswith("sed -i 's/"))
    ids, target = build.tm.chat_sample(tok, build.edit_conversation(task, addressed), [build.BASH_TOOL])
    a, b = build.turn_runs(target)[-1]
    segs = build._segments(tok, ids[a:b])
    call = build.edit_conversation(task, addressed)[-1]["tool_calls"][0]
    command = json.loads(call["function"]["arguments"])["command"]
    line = "".join(tok.decode([ids[a + k]]) for k in segs["line"])
    assert line == (command.split("'")[1].split("s/")[0] if addressed else "")
    assert "".join(tok.decode([ids[a + k]]) for k in segs["edit"]).strip().endswith(build.module_name(task))
    part = lambda name: "".join(tok.decode([ids[a + k]]) for k in segs[name])  # noqa: E731 (tokens may overhang)
    span, repl = command.split("s/", 1)[1].split("/")[:2]
    assert span in part("span") and repl in part("repl") and build.module_name(task) in part("file")
    assert "sed" not in part("span") + part("repl") and build.module_name(task) not in part("span")


def test_renamed_project_episode_names_only_the_new_project():
    task = next(t for t in TASKS if t["project"] == "strutil")
    episode, _ = solver_episode(task, random.Random(1))
    renamed = build.rename_project(episode, "strutil", "zokafu")
    text = json.dumps(renamed["messages"])
    assert "strutil" not in text and "zokafu.py" in text and "test_zokafu.py" in text
    assert json.dumps(episode["messages"]).replace("strutil", "zokafu") == text
    assert "strutil" in json.dumps(episode["messages"])  # the original is left as it was


def _fix_episode(task: dict) -> dict:
    """Look (the real ``cat -n`` listing), the solver's fix, the tests, submit."""
    messages = build.edit_conversation(task, addressed=False)
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "exit code 0\n"})
    return {"task_id": task["id"], "messages": messages, "tools": [build.BASH_TOOL]}


def test_identifier_renamed_fix_still_finds_its_span_in_the_renamed_listing():
    projects = {t["project"]: t for t in TASKS}
    checked = 0
    for task in projects.values():
        mapping = build.identifier_mapping(task, random.Random(task["id"]), set())
        assert mapping and build._renamed_tests_pass(task, mapping), task["project"]
        renamed = build.rename_identifiers(_fix_episode(task), task, mapping)
        assert renamed is not None, task["id"]
        listing = renamed["messages"][3]["content"]
        fix = build._commands(renamed)[1]
        module = build.rename_text(task["files"][build.module_name(task)], mapping)
        assert listing == build.observation(0, build.cat_n(module))
        assert build.apply_edit(module, fix) == build.rename_text(task["solution"], mapping), fix
        m = build._SED.fullmatch(fix)
        if m and m.group(2) and m.group(2) != ".*":  # a span, not the whole-line form
            assert m.group(2) in listing
            checked += 1
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", listing + fix))
        renamed_names = {k for k, v in mapping.items() if k != v}  # the project keeps its name here
        assert not words & renamed_names, task["project"]  # no original name is left to copy from memory
        assert renamed["messages"][0] == _fix_episode(task)["messages"][0]  # the system text stays
    assert checked >= 5  # the s/// form is checked, not only allowed


def test_renamed_task_is_the_same_fix_under_other_names():
    task = next(t for t in TASKS if t["project"] == "bank")
    renamed = build.renamed_task(task, random.Random(0))
    text = json.dumps([renamed[k] for k in ("prompt", "files", "solution")])  # what an episode shows
    assert "bank" not in text and "withdraw" not in text and "balance" not in text
    module = build.module_name(renamed)
    fix = build._commands({"messages": build.edit_conversation(renamed, False)})[-1]
    assert fix.endswith(" " + module) and build.apply_edit(renamed["files"][module], fix) == renamed["solution"]
    graded = json.dumps([renamed[k] for k in ("hidden_tests", "failing_visible_tests", "function")])
    assert "bank" not in graded and "withdraw" not in graded and "balance" not in graded


def test_renamed_copies_score_as_the_originals_and_avoid_the_names_asked():
    import rename_swe_tasks

    tasks = [next(t for t in TASKS if t["project"] == p) for p in ("bank", "stats")]  # two projects
    first = rename_swe_tasks.renamed_copies(tasks, 2, "s", set(), "renamed")
    assert [t["id"] for t in first] == [f"renamed{k}-{t['id']}" for t in tasks for k in (0, 1)]
    assert all(rename_swe_tasks.valid(t) for t in first)  # buggy 0.0, renamed solution 1.0, sandboxed
    assert rename_swe_tasks.renamed_copies(tasks, 2, "s", set(), "renamed") == first  # deterministic
    taken = rename_swe_tasks.names_of(first[0]) | rename_swe_tasks.names_of(first[3])
    again = rename_swe_tasks.renamed_copies(tasks, 2, "s", taken, "renamed")
    assert not any(rename_swe_tasks.names_of(t) & taken for t in again)


def test_broad_names_are_made_of_vocabulary_pieces_and_never_name_a_held_out_project_or_function():
    pieces = ("b", "se", "ar", "ch", "stack", "push", "ratio", "low", "high", "item")
    rng = random.Random(0)
    names = [build.fresh_name(rng, pieces) for _ in range(3000)]
    assert not set(names) & build.held_out_names()  # "stack" alone, or "ratio", is refused
    assert {"stack", "ratio", "bsearch"} <= build.held_out_names()
    made_of_pieces = [n for n in names if re.fullmatch(f"(?:{'|'.join(pieces)})(?:_?(?:{'|'.join(pieces)}))*", n)]
    assert 0.6 < len(made_of_pieces) / len(names) < 0.9  # three in four; the rest syllable names
    assert sum(1 for n in names if len(n) > 8) > 300  # runs of short pieces too
    assert build.fresh_name(random.Random(5), pieces) == build.fresh_name(random.Random(5), pieces)
    task = next(t for t in TASKS if t["project"] == "bank")
    mapping = build.identifier_mapping(task, random.Random(1), set(), pieces)
    assert not set(mapping.values()) & build.held_out_names() and len(set(mapping.values())) == len(mapping)


def test_identifier_renaming_leaves_library_names_and_drops_a_copy_whose_span_breaks():
    task = next(t for t in TASKS if t["project"] == "caesar")
    assert "lower" not in build.project_identifiers(task)  # `c.lower()` is str's method
    text = "    s = p.read_text()\n    text = 1\n    return test_text_ok(text)\n"
    renamed = build.rename_text(text, {"text": "bofa"})
    assert renamed == "    s = p.read_text()\n    bofa = 1\n    return test_bofa_ok(bofa)\n"
    toy = {"id": "toy", "project": "toy", "files": {"toy.py": "rows = 1\nx = rows + 2\n", "test_toy.py": ""},
           "solution": "rows = 1\nx = rows + 3\n", "prompt": "fix toy.py"}
    steps = [("cat -n toy.py", build.observation(0, build.cat_n(toy["files"]["toy.py"])))]
    breaks = build.conversation(toy, steps + [("sed -i '2s/o/0/' toy.py", "exit code 0\n")])
    keeps = build.conversation(toy, steps + [("sed -i 's/+ 2/+ 3/' toy.py", "exit code 0\n")])
    assert build.rename_identifiers({"messages": breaks}, toy, {"rows": "bibi"}) is None
    assert "bibi + 2" in json.dumps(build.rename_identifiers({"messages": keeps}, toy, {"rows": "bibi"}))


def test_an_identifier_inside_the_project_name_leaves_the_module_name_alone():
    """Generated projects are often named after one of their identifiers (`batch` in batch_tracker.py):
    the renamed copy must still import its module (before, a third of them were refused)."""
    solution = "def heaviest_batch(batches):\n    return max(batches)\n"
    task = {"id": "t", "project": "batch_tracker", "solution": solution,
            "files": {"batch_tracker.py": solution,
                      "test_batch_tracker.py": "from batch_tracker import heaviest_batch\n\n\n"
                                               "def test_heaviest():\n    assert heaviest_batch([1, 3]) == 3\n"}}
    mapping = build.identifier_mapping(task, random.Random(0), set())
    assert {"batches", "heaviest_batch"} <= set(mapping) and mapping["batch_tracker"] == "batch_tracker"
    renamed = build.rename_text(task["files"]["test_batch_tracker.py"], mapping)
    assert renamed.startswith("from batch_tracker import " + mapping["heaviest_batch"])
    assert build._renamed_tests_pass(task, mapping)


def test_evaluation_summary_says_how_far_episodes_got():
    task = next(t for t in TASKS if t["project"] == "bank")
    name = build.module_name(task)
    line = next(x for x in task["files"][name].splitlines() if "return" in x).strip()

    def run(*commands, reward=0.0):
        messages = [build.call_message(c, f"call_{i}") for i, c in enumerate(commands)]
        messages.append({"role": "assistant", "tool_calls": [{"id": "x", "type": "function",
                                                              "function": {"name": "bash", "arguments": "[1]"}}]})
        return {"task_id": task["id"], "reward": reward, "calls": len(commands), "submitted": False,
                "messages": messages}

    runs = [run(f"cat -n {name}", f"sed -i 's/{line}/pass/' {name}", reward=1.0),
            run("cat -n other.py", f"sed -i 's/no such text/x/' {name}"),
            run("ls")]
    summary = build.summarise(runs, [task] * 3)
    assert summary["success"] == round(1 / 3, 4) and summary["tasks_ever_solved"] == 1
    assert (summary["looked"], summary["sed_right_file"], summary["span_found"]) == (
        round(1 / 3, 4), round(2 / 3, 4), round(1 / 3, 4))


def test_sft_tokenises_as_the_saved_model_is_served(tmp_path):
    """The ids SFT trains on are the ids AutoTokenizer (vLLM, the trainer) gives for the saved model;
    the freshly built BPE alone would not give them (transformers 5 loads a qwen2 model's tokenizer as
    Qwen2Tokenizer, with Qwen's pre-tokenizer)."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    # conversations with a `cat -n` listing (where the two pre-tokenizers differ)
    episodes = [{"messages": build.edit_conversation(t), "tools": [build.BASH_TOOL]} for t in TASKS[::10]]
    built = build.make_tokenizer(episodes, vocab=2048, max_len=4096)
    config = build.tm.model_config(built, layers=1, hidden=64, heads=1, max_positions=2048)
    served = build.served_tokenizer(built, config)
    torch.manual_seed(0)
    build.tm.save_checkpoint(Qwen2ForCausalLM(config), served, tmp_path / "m")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = "".join(built.apply_chat_template(e["messages"], tools=e["tools"], tokenize=False) for e in episodes)
    ids = lambda tok: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids(served) == ids(loaded)
    assert ids(built) != ids(loaded)  # what the fix is for: without it SFT saw other ids than serving


def test_upsample_repeats_one_source_and_refuses_unknown_names(tmp_path):
    """--upsample NAME=K: that file's episodes count K times, the rest once; a name that is not a
    --trajectories file, or a rule without a count, is a clear error, not a silent no-op."""
    import click

    rows = [(name, task, call) for name, task in (("a.jsonl", "t1"), ("b.jsonl", "t2"), ("b.jsonl", "t3"))
            for call in (0, 1)]
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("".join(
            json.dumps({"task_id": task, "call_index": call, "action": "look",
                        "request": {"messages": [{"role": "user", "content": task}]},
                        "reply": {"role": "assistant", "content": f"{task}-{call}"}}) + "\n"
            for n, task, call in rows if n == name))
    episodes = build.load_trajectories([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert sorted((e["source"], e["task_id"]) for e in episodes) == [
        ("a.jsonl", "t1"), ("b.jsonl", "t2"), ("b.jsonl", "t3")]
    out = build.upsampled(episodes, ("b.jsonl=3",))
    assert sorted(e["task_id"] for e in out) == ["t1", "t2", "t2", "t2", "t3", "t3", "t3"]
    assert build.upsampled(episodes, ()) == episodes
    with pytest.raises(click.BadParameter, match="no --trajectories file named c.jsonl"):
        build.upsampled(episodes, ("c.jsonl=2",))
    with pytest.raises(click.BadParameter, match="expected NAME=K"):
        build.upsampled(episodes, ("b.jsonl",))


def test_packed_trajectories_give_the_same_episodes_in_fewer_bytes(tmp_path):
    """--pack keeps each episode's last call and every call's action: the SFT reads the same
    conversations (same source name, so --upsample rules still apply) from a file small enough to
    commit, and the same input packs to the same bytes. Calls may come in any order."""
    rows = []
    for ep, task in enumerate(("t1", "t2")):
        messages = [{"role": "user", "content": task}]
        for call, action in enumerate(("look", "wrong", "fix", "submit")[: 3 + ep]):
            reply = {"role": "assistant", "content": f"{task}-{call}"}
            rows.append({"task_id": task, "episode": ep, "call_index": call, "action": action, "reward": 1.0,
                         "request": {"messages": list(messages), "tools": [{"name": "bash"}]}, "reply": reply})
            messages += [reply, {"role": "tool", "content": "ok", "tool_call_id": f"c{call}"}]
    raw = tmp_path / "raw" / "calls.jsonl"
    raw.parent.mkdir()
    raw.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    first, tasks_run = build.pack_trajectories(raw, tmp_path / "calls.jsonl.gz")
    packed = (tmp_path / "calls.jsonl.gz").read_bytes()
    assert first["episodes"] == 2 and first["bytes"] < raw.stat().st_size and tasks_run == {"t1", "t2"}
    assert build.pack_trajectories(raw, tmp_path / "again.gz")[0]["sha256"] == first["sha256"]
    assert (tmp_path / "again.gz").read_bytes() == packed
    want = sorted(build.load_trajectories([raw]), key=lambda e: e["task_id"])
    got = sorted(build.load_trajectories([tmp_path / "calls.jsonl.gz"]), key=lambda e: e["task_id"])
    assert got == want
    assert [e["kinds"] for e in got] == [["look", "wrong", "fix"], ["look", "wrong", "fix", "submit"]]
    assert got[0]["source"] == "calls.jsonl" and len(got[1]["messages"]) == 1 + 2 * 3 + 1
    tasks = tmp_path / "raw" / "tasks_x.jsonl"  # --pack with --extra-tasks: only the tasks episodes name
    tasks.write_text("".join(json.dumps({"id": i, "files": {}}) + "\n" for i in ("t0", "t1", "t2", "t9")))
    build.pack_all([raw], [tasks], tmp_path / "packed")
    assert [json.loads(line)["id"] for line in build._lines(tmp_path / "packed" / "tasks_x.jsonl.gz")] == ["t1", "t2"]
    assert (tmp_path / "packed" / "calls.jsonl.gz").read_bytes() == packed


def test_task_files_may_repeat_a_task_but_not_reuse_its_id():
    import click

    a = {"id": "p-f-wrong_operator-0", "files": {"p.py": "x = 1\n"}}
    assert build.tasks_by_id([a, dict(a)]) == {a["id"]: a}
    with pytest.raises(click.UsageError, match="p-f-wrong_operator-0"):
        build.tasks_by_id([a, {**a, "files": {"p.py": "x = 2\n"}}])


def test_grown_model_computes_the_same_function_and_then_trains_its_new_layers():
    """--grow-layers: the committed model with silent copies interleaved gives the same logits (so the
    warm start is kept), and one SFT step moves the new layers' zeroed projections."""
    import click
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(ROOT / "examples" / "swe" / "model").eval()
    bigger = build.grown(model, 2).eval()
    assert bigger.config.num_hidden_layers == model.config.num_hidden_layers + 2
    assert len(bigger.config.layer_types) == bigger.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, bigger(ids).logits)
    silent = bigger.model.layers[1]  # the copy of layer 0
    assert torch.equal(silent.self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert not silent.mlp.down_proj.weight.any()
    bigger.train()
    build.weighted_nll(bigger, [(ids[0].tolist(), [1.0] * 40)], 0).backward()
    assert silent.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(click.BadParameter, match="between 1 and"):
        build.grown(model, 9)


def test_in_process_episodes_run_the_committed_model_repeatably_and_show_progress(capsys):
    """The held-out evaluation's loop (``--eval-only``) with the committed model: real sampling, the
    model's commands in the sandbox, the hidden tests scoring each folder; the same seed gives the same
    episodes (figures of different builds are compared on that), and each call round says how many
    episodes are still running."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model_dir = ROOT / "examples" / "swe" / "model"
    model, tok = Qwen2ForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    model.eval()
    tasks = build.read_tasks("eval")[:2]

    def episodes():
        return build.agent_rollouts(model, tok, tasks, 3, 0.7, torch.Generator().manual_seed(0))

    first, again = episodes(), episodes()
    assert [r["messages"] for r in first] == [r["messages"] for r in again]
    for run, task in zip(first, tasks):
        assert run["task_id"] == task["id"] and 1 <= run["calls"] <= 3 and run["reward"] in (0.0, 1.0)
        assert run["messages"][0]["role"] == "system" and run["messages"][1]["content"] == task["prompt"]
        assert sum(m["role"] == "assistant" for m in run["messages"]) == run["calls"]
    err = capsys.readouterr().err
    assert "[eval] call 1/3: 2 of 2 episodes still running" in err and "[eval] scoring 2 episodes" in err


def test_a_fresh_larger_model_on_the_committed_tokenizer_and_samples_from_worker_processes(tmp_path):
    """--tokenizer: a fresh model of the asked size on the committed model's ids (so a larger warm
    start serves and trains like the committed one); the samples tokenised in worker processes are
    the ones one process makes; --init with --tokenizer is refused (one continues, one starts fresh)."""
    import gzip

    from click.testing import CliRunner
    from transformers import AutoConfig, AutoTokenizer

    committed = ROOT / "examples" / "swe" / "model"
    source = ROOT / "examples" / "swe" / "data" / "train_noise1.jsonl.gz"
    part = tmp_path / "train_noise1.jsonl.gz"
    part.write_bytes(gzip.compress("".join(line + "\n" for line in build._lines(source)[:8]).encode()))
    episodes = build.load_trajectories([part])
    tok = AutoTokenizer.from_pretrained(committed)
    one = build.weighted_samples(tok, episodes, 3.0, True, workers=1)
    assert build.weighted_samples(tok, episodes, 3.0, True, workers=2) == one
    assert any(w == 3.0 for _, weights in one for w in weights) and len(one) == 8

    args = ["--trajectories", str(part), "--tokenizer", str(committed), "--names", "broad", "--id-renames", "1",
            "--layers", "1", "--hidden", "64", "--steps", "2", "--batch", "2", "--workers", "2", "--no-eval",
            "--out", str(tmp_path / "m")]
    result = CliRunner().invoke(build.main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (64, 1, False)
    assert AutoTokenizer.from_pretrained(tmp_path / "m").get_vocab() == tok.get_vocab()
    info = json.loads((tmp_path / "m" / "build_info.json").read_text())
    assert info["tokenizer"] == str(committed) and info["init"] is None and info["steps"] == 2
    refused = CliRunner().invoke(build.main, args + ["--init", str(committed)])
    assert refused.exit_code != 0 and "--tokenizer starts a fresh one" in refused.output
