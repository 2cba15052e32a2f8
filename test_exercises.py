"""The course kit: a student's copy, blanked, must fail exactly the blanked assignment's grading
tests, naming it; the project itself passes them all; `make` refuses what it cannot do."""
import importlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import exercises


def test_every_grading_test_exists():
    """The tests an assignment names are the suite's (a renamed test would leave it ungraded
    until the slow blanked copies ran)."""
    for a in exercises.ASSIGNMENTS:
        for node in a.tests:
            file, name = node.split("::")
            module = importlib.import_module(file.removesuffix(".py"))
            assert callable(getattr(module, name, None)), f"{a.name}: no test {node}"


def blanked_copy_results(name: str, folder: str) -> dict:
    """Make a copy with one assignment blanked and grade every assignment in it."""
    file = exercises.BY_NAME[name].function.split(":")[0]
    source = open(os.path.join(exercises.HERE, file)).read()
    exercises.make(folder, exercises.chosen(name), force=False)
    assert open(os.path.join(exercises.HERE, file)).read() == source, "the source changed"
    assert "exercise " + name in open(os.path.join(folder, file)).read()
    return {a.name: why for a, why in exercises.check(exercises.ASSIGNMENTS, folder)}


@pytest.mark.slow
def test_a_blanked_assignment_fails_alone_and_names_itself(tmp_path, monkeypatch):
    """In each copy the blanked assignment's tests fail naming it and every other assignment's
    pass: so the project, a copy with nothing blanked, passes them all."""
    # two copies graded at a time, one thread each: the grading runs are mostly start-up
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    names = [a.name for a in exercises.ASSIGNMENTS]
    with ThreadPoolExecutor(2) as pool:
        graded = pool.map(blanked_copy_results, names, [str(tmp_path / n) for n in names])
    problems = {}                                 # every assignment's, not the first only
    for name, results in zip(names, graded):
        why = results.pop(name)
        if why is None or f"exercise {name}:" not in why:
            problems[name] = f"its own tests did not fail naming it: {why}"
        elif any(w is not None for w in results.values()):
            problems[name] = f"blanking it broke {results}"
    assert not problems, problems


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
