"""The course kit: assignments made of the project's own functions, a student's copy with their
bodies blanked, and the tests that grade them (EXERCISES.md says how a course uses them).

    python exercises.py list                    one assignment a line
    python exercises.py make OUT [--only A,B]   a student's copy in OUT (default: all blanked)
    python exercises.py check [A,B]             grade, in a copy or here; exit 1 if any fails
"""
import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = {".git", ".venv", "__pycache__", ".pytest_cache"}      # not copied into a student's copy


@dataclass
class Assignment:
    name: str
    function: str        # FILE:QUALNAME, the body a student writes
    minutes: int
    task: str            # what to implement and why it matters
    hint: str
    tests: tuple         # the pytest node ids (a prefix matches parametrized ones) that grade it


ASSIGNMENTS = [
    Assignment("kv-rollback", "model.py:KVCache.keep", 20,
               "After verification only the accepted path's keys and values may stay in the "
               "cache: move the kept slots, in order, to the front of the new region and cut the "
               "rest, for every layer at once. Without it the next step attends to rejected "
               "drafts.",
               "index_select along the slot dimension, then one slice assignment.",
               ("test_spec.py::test_keeping_a_subset_of_slots_equals_appending_only_those",
                "test_spec.py::test_compacted_cache_equals_plain_decoding_cache")),
    Assignment("tree-mask", "tree.py:ancestor_mask", 25,
               "A tree is verified in one forward: each node may see its ancestors and itself, "
               "nothing else. Build that (N, N) mask from the parent of each node.",
               "Walk every node's ancestor chain at once: one step per depth level (nodes need not "
               "come in depth order: tree.path_first moves a path to the front).",
               ("test_spec.py::test_tree_mask_positions_and_paths_equal_brute_force",)),
    Assignment("greedy-accept", "verification.py:accept_tree", 40,
               "From the target's own choice after every node, find the longest root-to-leaf "
               "path whose drafted tokens the target agrees with, and the token it adds after "
               "it. Done in tensors, it serves greedy and sampled choices alike.",
               "A path is accepted up to its first mismatch: a cumulative product of matches.",
               ("test_spec.py::test_greedy_tree_acceptance_equals_walking_the_tree",
                "test_spec.py::test_tree_sampling_verification_keeps_target_distribution",
                "test_spec.py::test_tree_sampling_negative_control_is_rejected")),
    Assignment("chain-accept", "verification.py:accept_chain_sampled", 45,
               "Leviathan's rule: accept drafted token x with probability min(1, p(x) / q(x)); at "
               "the first rejection draw from the residual max(p - q, 0), normalized; if all are "
               "accepted draw a bonus token from p. The output then follows p exactly.",
               "Draw all the uniforms at once; the first rejection is an argmax over a mask.",
               ("test_spec.py::test_sampled_chain_verification_keeps_target_distribution",
                "test_spec.py::test_sampled_chain_negative_control_is_rejected",
                "test_spec.py::test_a_draft_equal_to_the_target_is_always_accepted")),
    Assignment("position-draws", "verification.py:sample_at", 15,
               "Sampling by inverse CDF at a given uniform u: the token whose cumulative "
               "probability first exceeds u. Keyed on the position, it makes a seeded run give "
               "plain sampling's very text whatever the tree.",
               "torch.searchsorted on the cumulative sum; mind the last bucket.",
               ("test_exact.py::test_position_keyed_draws_follow_p_and_differ_by_position_"
                "and_seed",)),
    Assignment("tree-growth", "tree.py:grow_tree", 60,
               "EAGLE-2's dynamic tree: expand the top-k frontier by cumulative log-probability, "
               "round by round, then keep the `total` best nodes of all drafted, as a tree.",
               "Keep a node's cumulative score; the kept set must contain every kept node's parent "
               "(scores only fall along a path).",
               ("test_spec.py::test_grow_tree_equals_brute_force_expansion_rule",)),
    Assignment("medusa-tree", "heads.py:best_paths", 30,
               "Medusa's static tree from measured accuracies: the `size` paths of ranks most "
               "likely to be accepted, the product of their accuracies, chosen greedily.",
               "A heap of candidates: taking a path offers its first child and its next sibling.",
               ("test_heads.py::test_best_paths_equal_brute_force",)),
    Assignment("eagle-ttt", "training.py:ttt_mask", 30,
               "EAGLE-3's training-time test: an EAGLE head learns to draft several steps from "
               "its own predicted features. Build the attention mask of unrolled step j, so that "
               "each entry sees exactly what a tree node of that depth sees at inference.",
               "Entry i at step j drafts from the root at i - j: the true entries up to it, then "
               "one entry of its own path per earlier step.",
               ("test_heads.py::test_training_time_test_unroll_equals_drafting_at_inference",)),
]
BY_NAME = {a.name: a for a in ASSIGNMENTS}


def chosen(text: str | None) -> list:
    """A comma list of assignment names -> the assignments (all for None); ValueError names
    an unknown one and lists the names."""
    if not text:
        return ASSIGNMENTS
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown assignment {', '.join(unknown)}; the assignments: "
                         f"{', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def blank(source: str, qualname: str, name: str, hint: str = "") -> str:
    """source with the body of function qualname ("Class.method" or "function") replaced by a
    NotImplementedError naming the exercise (after the hint, as a comment); its signature and
    docstring stay."""
    node = find(ast.parse(source), qualname.split("."))
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    lines = source.split("\n")
    first, last = body[0].lineno - 1, node.end_lineno                 # 0-based, end exclusive
    indent = re.match(r"\s*", lines[first]).group(0)
    stub = f'{indent}raise NotImplementedError("exercise {name}: write {qualname} (EXERCISES.md)")'
    hints = [f"{indent}# hint: {hint}"] if hint else []
    return "\n".join(lines[:first] + hints + [stub] + lines[last:])


def find(tree: ast.AST, path: list) -> ast.AST:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == path[0]:
            return node if len(path) == 1 else find(node, path[1:])
    raise ValueError(f"no {'.'.join(path)} in the source")


def make(out: str, assignments: list, force: bool) -> None:
    """Copy the project to out with the assignments' bodies blanked; the source is not touched."""
    out = os.path.abspath(out)
    if out == HERE or out.startswith(HERE + os.sep):
        raise ValueError(f"{out}: inside the project itself; give a folder outside it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out}: a file; give a folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"{out}: not empty (--force writes into it anyway)")
    shutil.copytree(HERE, out, dirs_exist_ok=True,
                    ignore=lambda folder, names: [n for n in names if n in SKIP])
    for a in assignments:
        file, qualname = a.function.split(":")
        path = os.path.join(out, file)
        with open(path) as f:
            text = blank(f.read(), qualname, a.name, a.hint)
        with open(path, "w") as f:
            f.write(text)


def check(assignments: list, folder: str = HERE) -> list:
    """Run the grading tests of the assignments in folder -> [(assignment, failure or None)]."""
    nodes = [t for a in assignments for t in a.tests]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           *nodes], cwd=folder, capture_output=True, text=True,
                          env=os.environ | {"COLUMNS": "1000"})   # summary lines uncut
    outcome = {}                                  # node id -> None (passed) or the failure line
    for line in done.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR) (\S+)(?: - (.*))?", line)
        if m:
            outcome.setdefault(m.group(2), None if m.group(1) == "PASSED" else m.group(3) or "")
    results = []
    for a in assignments:
        mine = {n: why for n, why in outcome.items() if any(n.startswith(t) for t in a.tests)}
        failed = [why for why in mine.values() if why is not None]
        missing = [t for t in a.tests if not any(n.startswith(t) for n in mine)]
        results.append((a, failed[0] if failed else f"tests not run: {missing}" if missing
                        else None))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one assignment a line: name, minutes, what to write")
    m = sub.add_parser("make", help="a student's copy with the chosen bodies blanked")
    m.add_argument("out", help="the folder of the copy (new, or empty)")
    m.add_argument("--only", metavar="A,B", help="these assignments only (default: all)")
    m.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    c = sub.add_parser("check", help="run the grading tests; one pass/fail line an assignment")
    c.add_argument("names", nargs="?", metavar="A,B", help="these assignments (default: all)")
    args = p.parse_args(argv)
    try:
        if args.command == "list":
            wide = max(len(a.function) for a in ASSIGNMENTS)
            for a in ASSIGNMENTS:
                what = a.task.split(". ")[0]
                print(f"{a.name:<15} {a.minutes:>3} min  {a.function:<{wide}}  "
                      f"{what if len(what) < 60 else what[:57] + '...'}")
        elif args.command == "make":
            make(args.out, chosen(args.only), args.force)
            print(f"a student's copy in {args.out}; grade it there: python exercises.py check")
        else:
            results = check(chosen(args.names))
            for a, why in results:
                verdict = "pass" if why is None else "FAIL"
                print(f"{verdict}  {a.name}" + (f": {why}" if why else ""))
            if any(why is not None for _, why in results):
                sys.exit(1)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
