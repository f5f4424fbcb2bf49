"""Task files, rollout identities and command templates: the inputs of a batch, checked before anything runs."""

from __future__ import annotations

import json
import shlex
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_harness.launcher.command import render_command, substitute
from lightning_harness.launcher.identity import batch_run_id, plan_rollouts, rollout_id, safe_id
from lightning_harness.launcher.tasks import Task, TaskFileError, load_tasks, tasks_from_rows


def test_jsonl_json_and_parquet_give_the_same_tasks(tmp_path):
    rows = [{"id": "a", "q": "1+1", "n": 2}, {"id": "7", "q": "2+2", "n": None}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "t.json").write_text(json.dumps({"tasks": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    loaded = [load_tasks(tmp_path / f"t.{ext}") for ext in ("jsonl", "json", "parquet")]
    for tasks in loaded:
        assert [t.id for t in tasks] == ["a", "7"]
        assert tasks[0].fields["q"] == "1+1" and tasks[0].fields["task_id"] == "a"
    assert loaded[0] == loaded[1] == loaded[2]


def test_id_field_option_and_limit(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"name": "x", "id": 1}\n{"name": "y", "id": 2}\n')
    assert [t.id for t in load_tasks(p, id_field="name")] == ["x", "y"]
    assert [t.id for t in load_tasks(p, limit=1)] == ["1"]  # integer ids become strings


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": "a"}\n{"id": "b"\n', "t.jsonl:2: not valid JSON"),
        ('{"id": "a"}\n{"q": 1}\n', "t.jsonl:2: missing task id field"),
        ('{"id": "a"}\n{"id": "a"}\n', "duplicate task id 'a'"),
        ('{"id": ""}\n', "task id is empty"),
        ('{"id": [1]}\n', "task id must be a string or integer"),
        ('[1, 2]\n', "a task must be a JSON object"),
        ("\n\n", "no tasks in file"),
    ],
)
def test_bad_task_files_name_file_line_and_reason(tmp_path, content, message):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    with pytest.raises(TaskFileError) as exc:
        load_tasks(p)
    assert message in str(exc.value)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(TaskFileError, match="not found"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "t.csv").write_text("id\n1\n")
    with pytest.raises(TaskFileError, match="unknown task file type"):
        load_tasks(tmp_path / "t.csv")


def test_safe_ids_are_credential_safe_distinct_and_stable():
    assert safe_id("plain-id_1.x") == "plain-id_1.x"
    weird = ["a/b", "a b", "a~b", "a:b@c"]
    ids = [safe_id(w) for w in weird]
    assert len(set(ids)) == len(ids)
    for i in ids:
        assert all(c.isalnum() or c in "._-" for c in i)
    assert safe_id("a/b") == safe_id("a/b")
    assert len(safe_id("x" * 500)) <= 80
    assert rollout_id("run", "t/1", 3) == f"run-{safe_id('t/1')}-3"
    assert rollout_id("run", "t", 0, step=5) == "run-s5-t-0"


def test_plan_groups_samples_by_task_and_rejects_collisions():
    tasks = tasks_from_rows([{"id": "a"}, {"id": "b"}])
    specs = plan_rollouts(tasks, run_id="r", samples=3, step=2)
    assert [s.rollout_id for s in specs[:3]] == ["r-s2-a-0", "r-s2-a-1", "r-s2-a-2"]
    assert {s.group_id for s in specs} == {"a@2", "b@2"}
    assert specs[0].credential(4) == "r-s2-a-0~4"
    with pytest.raises(ValueError, match="samples"):
        plan_rollouts(tasks, run_id="r", samples=0)
    with pytest.raises(ValueError, match="'~'"):
        plan_rollouts(tasks, run_id="r~1", samples=1)
    ev = plan_rollouts(tasks, run_id="r", samples=1, step=2, split="eval")
    assert [(s.rollout_id, s.group_id) for s in ev] == [("r-eval-s2-a-0", "eval:a@2"), ("r-eval-s2-b-0", "eval:b@2")]
    custom = plan_rollouts(tasks, run_id="r", samples=1, group_fn=lambda t, step: "all")
    assert {s.group_id for s in custom} == {"all"}
    assert batch_run_id("t", "a", "cmd") == batch_run_id("t", "a", "cmd") != batch_run_id("t", "a", "cmd2")


def test_command_templates_substitute_known_names_only_and_quote_in_shells():
    values = {"task_id": "t1", "question": "2+2; rm -rf /", "n": 3, "obj": {"a": 1}}
    argv = render_command(["h", "--task", "{task_id}", "--q={question}", '{"json": {n}}', "{unknown}"], values)
    assert argv == ["h", "--task", "t1", "--q=2+2; rm -rf /", '{"json": 3}', "{unknown}"]
    line = render_command("echo {question} {obj}", values)
    assert shlex.split(line) == ["echo", "2+2; rm -rf /", '{"a": 1}']
    out = subprocess.run(line, shell=True, capture_output=True, text=True, check=True).stdout
    assert out.strip() == '2+2; rm -rf / {"a": 1}'
    assert substitute("{a}{b}", {"a": None}) == "{b}"
    with pytest.raises(ValueError):
        render_command([], values)


def test_task_json_is_the_row():
    t = Task("a", {"id": "a", "x": [1, 2]})
    assert json.loads(t.to_json()) == {"id": "a", "x": [1, 2]}
