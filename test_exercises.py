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


def start_traced_run(folder, order: str) -> subprocess.Popen:
    """Start every grading test in the project, in this order ("forward" or "reverse"),
    tracing calls into folder/ORDER.json."""
    plugin = folder / "plugin"
    plugin.mkdir(exist_ok=True)
    (plugin / "trace_calls.py").write_text(TRACER)
    watched = {a.function: a.name for a in exercises.ASSIGNMENTS}
    nodes = [t for a in exercises.ASSIGNMENTS for t in a.tests]
    path = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"WATCHED": json.dumps(watched), "CALLS": str(folder / f"{order}.json"),
                        "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "trace_calls", "-p",
                             "no:cacheprovider", *(nodes[::-1] if order == "reverse" else nodes)],
                            cwd=exercises.HERE, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def traced_calls(folder, run: subprocess.Popen, order: str) -> dict:
    """{node id: [assignments it called]} of a finished traced run."""
    out = run.communicate()[0]
    assert run.returncode == 0, f"the project fails its grading tests: {out[-2000:]}"
    calls = json.loads((folder / f"{order}.json").read_text())
    assert "setup" not in calls, f"a fixture calls {calls.get('setup')}"
    return calls


def cross_calls(calls: dict) -> dict:
    """Assignments whose grading tests call another assignment's function, or not their own."""
    problems = {}
    for a in exercises.ASSIGNMENTS:
        mine = {node: got for node, got in calls.items() if node.startswith(a.tests)}
        uncalled = [t for t in a.tests if not any(node.startswith(t) for node in mine)]
        if uncalled or any(got != [a.name] for got in mine.values()):
            problems[a.name] = {"calls": mine, "tests that call nothing watched": uncalled}
    return problems


@pytest.mark.slow
def test_each_assignment_is_graded_by_its_own_tests_alone(tmp_path, monkeypatch):
    """Blanking one assignment fails its grading, naming it, and no other's. Shown by three
    runs, not one blanked copy an assignment: a blank changes only the body of its function,
    so it can fail only the tests that call it, or that use what an earlier test's call left
    behind (a cache). (1) Traced in the project, in the suite's order and reversed, every
    grading test calls its own assignment's function and no other's, and no fixture calls
    one: a cache that one test fills and another reads shows in one of the two orders. (2) In
    a student's copy with every assignment blanked (what `make` gives), each assignment's
    grading fails naming it: the first blank its tests reach is their own."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # three runs at a time, one thread each
    runs = {order: start_traced_run(tmp_path, order) for order in ("forward", "reverse")}
    try:
        sources = {a.function.split(":")[0] for a in exercises.ASSIGNMENTS}
        before = {f: open(os.path.join(exercises.HERE, f)).read() for f in sources}
        exercises.make(str(tmp_path / "copy"), exercises.ASSIGNMENTS, force=False)
        assert before == {f: open(os.path.join(exercises.HERE, f)).read() for f in sources}, \
            "make changed the project's own source"
        graded = exercises.check(exercises.ASSIGNMENTS, str(tmp_path / "copy"))
    except BaseException:                        # no traced run left behind
        for run in runs.values():
            run.kill()
        raise
    for order, run in runs.items():
        problems = cross_calls(traced_calls(tmp_path, run, order))
        assert not problems, f"{order}: grading tests that call other assignments: {problems}"
    unnamed = {a.name: why for a, why in graded if why is None or f"exercise {a.name}:" not in why}
    assert not unnamed, f"blanked, their grading did not fail naming them: {unnamed}"


def test_make_blanks_the_chosen_assignments_only(tmp_path):
    """--only: the chosen bodies are blanked, the others' stay."""
    exercises.make(str(tmp_path), exercises.chosen("tree-mask,medusa-tree"), force=False)
    tree, heads = (open(tmp_path / f).read() for f in ("tree.py", "heads.py"))
    assert "exercise tree-mask:" in tree and "exercise medusa-tree:" in heads
    assert "exercise tree-growth:" not in tree, "grow_tree is not chosen"
    untouched = open(os.path.join(exercises.HERE, "verification.py")).read()
    assert open(tmp_path / "verification.py").read() == untouched


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
