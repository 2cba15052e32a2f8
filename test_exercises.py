"""The course kit: a student's copy, blanked, must fail exactly the blanked assignment's grading
tests, naming it; the project itself passes them all; `make` refuses what it cannot do."""
import importlib
import json
import os
import subprocess
import sys

import pytest

import exercises


def test_every_grading_test_exists():
    """The tests an assignment names are the suite's (a renamed test would leave it ungraded
    until the slow traced run ran)."""
    for a in exercises.ASSIGNMENTS:
        for node in a.tests:
            file, name = node.split("::")
            module = importlib.import_module(file.removesuffix(".py"))
            assert callable(getattr(module, name, None)), f"{a.name}: no test {node}"


# A pytest plugin for the traced run: which assignment functions each grading test calls.
TRACER = """
import json, os, sys, threading
import pytest

WATCHED = json.loads(os.environ["WATCHED"])          # "file.py:Qual.name" -> assignment
calls = {}                               # node id, or "setup" (fixtures) -> assignments
now = ["setup"]

def trace(frame, event, arg):
    code = frame.f_code
    name = WATCHED.get(os.path.basename(code.co_filename) + ":" + code.co_qualname)
    if name:
        calls.setdefault(now[0], set()).add(name)

def pytest_collection_finish(session):      # not during imports: tracing them is slow
    sys.settrace(trace)
    threading.settrace(trace)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    now[0] = item.nodeid                             # fixtures' calls stay under "setup"
    yield
    now[0] = "setup"

def pytest_unconfigure(config):
    sys.settrace(None)
    threading.settrace(None)
    with open(os.environ["CALLS"], "w") as f:
        json.dump({k: sorted(v) for k, v in calls.items()}, f)
"""


def start_traced_run(folder) -> subprocess.Popen:
    """Start every grading test in the project, tracing calls into folder/calls.json."""
    (folder / "plugin").mkdir()
    (folder / "plugin" / "trace_calls.py").write_text(TRACER)
    watched = {a.function: a.name for a in exercises.ASSIGNMENTS}
    nodes = [t for a in exercises.ASSIGNMENTS for t in a.tests]
    env = os.environ | {"WATCHED": json.dumps(watched), "CALLS": str(folder / "calls.json"),
                        "PYTHONPATH": str(folder / "plugin")}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "trace_calls", "-p",
                             "no:cacheprovider", *nodes], cwd=exercises.HERE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_each_assignment_is_graded_by_its_own_tests_alone(tmp_path, monkeypatch):
    """Blanking one assignment fails its own tests, naming it, and no other's. Shown by two
    runs, not one blanked copy an assignment: a blank changes only the body of its function,
    so it can fail only the tests that call it. (1) Traced in the project, every grading test
    calls its own assignment's function and no other's (and no fixture calls one). (2) In a
    student's copy with every assignment blanked (what `make` gives), each assignment's tests
    fail naming it: the first blank they reach is their own."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # two runs at a time, one core each
    tracing = start_traced_run(tmp_path)        # beside the blanked copy's grading, below
    sources = {a.function.split(":")[0] for a in exercises.ASSIGNMENTS}
    before = {f: open(os.path.join(exercises.HERE, f)).read() for f in sources}
    exercises.make(str(tmp_path / "copy"), exercises.ASSIGNMENTS, force=False)
    assert before == {f: open(os.path.join(exercises.HERE, f)).read() for f in sources}, \
        "make changed the project's own source"
    graded = exercises.check(exercises.ASSIGNMENTS, str(tmp_path / "copy"))
    out = tracing.communicate()[0]
    assert tracing.returncode == 0, f"the project fails its grading tests: {out[-2000:]}"
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert "setup" not in calls, f"a fixture or import calls {calls.get('setup')}"
    problems = {}
    for a in exercises.ASSIGNMENTS:
        mine = {node: got for node, got in calls.items() if node.startswith(a.tests)}
        uncalled = [t for t in a.tests if not any(node.startswith(t) for node in mine)]
        if uncalled or any(got != [a.name] for got in mine.values()):
            problems[a.name] = {"calls": mine, "tests that call nothing watched": uncalled}
    assert not problems, f"grading tests that call other assignments, or not their own: {problems}"
    for a, why in graded:
        assert why is not None and f"exercise {a.name}:" in why, (a.name, why)


def test_blanking_keeps_the_signature_and_docstring_and_touches_nothing_else(tmp_path):
    source = open(os.path.join(exercises.HERE, "tree.py")).read()
    out = exercises.blank(source, "ancestor_mask", "tree-mask")
    assert 'raise NotImplementedError("exercise tree-mask: write ancestor_mask' in out
    assert "def ancestor_mask(parents: torch.Tensor, depths: torch.Tensor)" in out
    before, after = source.split("def ancestor_mask")[0], out.split("def ancestor_mask")[0]
    assert before == after, "the code above the function changed"
    assert source.split("def positions")[1] == out.split("def positions")[1]
    method = exercises.blank(open(os.path.join(exercises.HERE, "model.py")).read(),
                             "KVCache.keep", "kv-rollback", "one slice assignment")
    assert "        # hint: one slice assignment\n        raise NotImplementedError(\"exercise " \
           "kv-rollback" in method


def test_make_refuses_unknown_names_full_folders_and_the_project(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown assignment nope; the assignments: kv-rollback"):
        exercises.chosen("nope")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        exercises.make(str(tmp_path / "full"), exercises.ASSIGNMENTS, force=False)
    with pytest.raises(ValueError, match="a file; give a folder"):
        exercises.make(str(tmp_path / "full" / "x"), exercises.ASSIGNMENTS, force=False)
    with pytest.raises(ValueError, match="inside the project"):
        exercises.make(os.path.join(exercises.HERE, "copy"), exercises.ASSIGNMENTS, force=False)
    with pytest.raises(SystemExit) as e:
        exercises.main(["make", str(tmp_path / "full"), "--only", "nope"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: unknown assignment")


def test_list_prints_one_aligned_line_an_assignment(capsys):
    exercises.main(["list"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [a.name for a in exercises.ASSIGNMENTS]
    tasks = {line.index(a.task[:20]) for line, a in zip(lines, exercises.ASSIGNMENTS)}
    assert len(tasks) == 1, "the tasks start in one column"
