"""The abuse table: bad input replayed through both command lines, in-process. Each case must
exit with the documented code (2: bad input), print exactly one line on stderr, `error: ...`,
naming the flag or file, print no traceback, and leave no output file behind. None of them
loads the default model: everything here is refused before that, or on a tiny checkpoint."""
import json
import os
import shutil

import pytest

from default_model import WEIGHTS
from test_spec import hf_checkpoint

TOKENIZER = f"{WEIGHTS}/smollm2-135m-draft/tokenizer.json"      # a real one, shipped


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny checkpoints, each broken one way (and one whole), and an output folder."""
    root = tmp_path_factory.mktemp("abuse")
    (root / "out").mkdir()
    good, small = root / "good", root / "small"
    hf_checkpoint(good, vocab_size=49152)                   # the tokenizer's 49,152 tokens
    shutil.copy(TOKENIZER, good / "tokenizer.json")
    hf_checkpoint(small)                                    # 97 tokens: too few for it
    shutil.copy(TOKENIZER, small / "tokenizer.json")

    def broken(name, file, change):
        folder = root / name
        shutil.copytree(good, folder)
        change(folder / file)
        return str(folder)

    return {
        "good": str(good), "small": str(small), "out": str(root / "out"),
        "cut weights": broken("cut", "model.safetensors",
                              lambda f: f.write_bytes(f.read_bytes()[:1000])),
        "bad tokenizer": broken("badtok", "tokenizer.json", lambda f: f.write_text("{oops")),
        "no tokenizer": broken("notok", "tokenizer.json", os.remove),
        "bad config": broken("badcfg", "config.json", lambda f: f.write_text('{"x": 1')),
        "bad mask": broken("badmask", "config.json", lambda f: edit_json(f, pard_token=99999)),
        "gpt2": broken("gpt2", "config.json", lambda f: edit_json(
            f, architectures=["GPT2LMHeadModel"], model_type="gpt2")),
        "yarn": broken("yarn", "config.json", lambda f: edit_json(
            f, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})),
        "no vocab": broken("novocab", "config.json", lambda f: edit_json(f, vocab_size=None)),
        "half llama3": broken("halfl3", "config.json", lambda f: edit_json(
            f, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4})),
        "a list": broken("list", "config.json", lambda f: f.write_text("[]")),
        "a file": str(good / "config.json"),
    }


# (flags, what the error line must contain); {name} is a folder of the fixture
SPEC_CASES = [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "-1"], "--temperature must be a finite number"),
    (["--temperature", "x"], "--temperature"),
    (["--top-p", "0"], "--top-p must be in (0, 1], not 0.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--method", "eagel2"], "--method: invalid choice: 'eagel2'"),
    (["--method", "eagle", "--num-speculative-tokens", "1000"],
     "--num-speculative-tokens must be at most 16"),
    (["--method", "draft", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be at least 1"),
    (["--method", "eagle2", "--draft-top-k", "100"], "--draft-top-k must be at most 8"),
    (["--method", "medusa", "--tree-size", "1000"], "--tree-size must be at most 64"),
    (["--tree-size", "big"], "--tree-size: expected a number >= 0 or auto"),
    (["--method", "ngram", "--ngram-max", "0"], "--ngram-max must be at least 1"),
    (["--method", "draft", "--draft-top-k", "2"],
     "--draft-top-k does not apply to --method draft; it shapes eagle2, eagle2+ngram"),
    (["--tree-size", "4"], "--tree-size does not apply to --method ar"),
    (["--method", "eagle2", "--draft", "d"], "--draft does not apply to --method eagle2"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens does not apply to --method ar"),
    (["--show-tree"], "--show-tree draws the draft trees of a speculative --method"),
    (["--verify-curve", "--method", "eagle2"], "--verify-curve times the target alone"),
    (["--verify-curve", "--bench", "{a file}"], "--verify-curve with --bench: the bench"),
    (["--method", "eagle2", "--head", "{a file}"], "config.json: a file, not a folder"),
    (["--device", "nosuchdevice"], "--device nosuchdevice is not available here"),
    (["--model", "random:smollm2-135m"], "--model random:SHAPE only with --verify-curve"),
    (["--model", "random:nosuch", "--verify-curve"], "unknown model shape 'nosuch'"),
    (["--methods", "ar,eagle2"], "--methods only with --bench"),
    (["--peers"], "--peers only with --bench"),
    (["--limit", "3"], "--limit only with --bench"),
    (["--categories", "math"], "--categories only with --bench"),
    (["--temperature", "0,0.7"], "several --temperature values only with --bench"),
    (["--bench", "{out}"], "--bench {out}: a folder; expected a JSONL file"),
    (["--bench", "/nonexistent.jsonl"], "--bench /nonexistent.jsonl: no such file"),
    (["--bench", "{a file}", "--method", "eagle2"], "--method with --bench"),
    (["--bench", "{a file}", "--show-tree"], "--show-tree with --bench"),
    (["--bench", "{a file}", "--methods", "ar,eagel2"], "--methods: unknown 'eagel2'"),
    (["--bench", "{a file}", "--limit", "-2"], "--limit must be at least 0, got -2"),
    (["--method", "eagle2", "--draft-top-k", "-1"], "--draft-top-k must be at least 1, got -1"),
    (["--json", "/nonexistent/folder/r.json"], "--json /nonexistent/folder/r.json: cannot write"),
    (["--json", "{out}"], "--json {out}: a folder"),
    (["--cache-dir", "/proc/nope"], "--cache-dir /proc/nope: cannot make it"),
    (["--cache-dir", "{a file}"], "--cache-dir {a file}: cannot make it"),
    (["--plot", "{out}"], "--plot only with --bench"),
    (["--bench", "{a file}", "--plot", "{a file}"], "--plot {a file}: a file; give a folder"),
    (["--bench", "{a file}", "--plot", "/nonexistent/p"], "--plot /nonexistent/p: cannot write"),
    (["--model", "/nonexistent/folder"], "model folder not found: /nonexistent/folder"),
    (["--model", "{a file}"], "config.json"),
    (["--model", "{cut weights}"], "model.safetensors"),
    (["--model", "{bad config}"], "config.json"),
    (["--model", "{gpt2}"], "{gpt2}/config.json: unsupported architecture 'GPT2LMHeadModel'"),
    (["--model", "{yarn}"], "{yarn}/config.json: unsupported rope_scaling type 'yarn'"),
    (["--model", "{no vocab}"], "{no vocab}/config.json: the field 'vocab_size' is missing"),
    (["--model", "{half llama3}"], "{half llama3}/config.json: rope_scaling llama3 needs factor"),
    (["--model", "{a list}"], "{a list}/config.json: expected a JSON object"),
    (["--model", f"{WEIGHTS}/smollm2-135m-eagle3"], "holds eagle3 heads, not a model: give the"),
    (["--model", "{bad tokenizer}"], "{bad tokenizer}/tokenizer.json: not valid JSON"),
    (["--model", "{no tokenizer}"], "no tokenizer.json or original/tokenizer.model"),
    (["--model", "{good}", "--method", "draft", "--draft", "{cut weights}"],
     "cannot read {cut weights}/model.safetensors (truncated or corrupt?)"),
    (["--model", "{good}", "--method", "draft", "--draft", "README.md"],
     "README.md: not a folder (a draft is a HF Llama folder)"),
    (["--model", "{good}", "--method", "draft", "--draft", "{bad mask}"],
     "{bad mask}/config.json: pard_token 99999 is no token id of the target's vocabulary"),
    (["--model", "{good}", "--method", "draft", "--draft", f"{WEIGHTS}/smollm2-135m-eagle3"],
     "holds eagle3 heads, not a draft model"),
    (["--model", "{good}", "--method", "eagle2", "--head", f"{WEIGHTS}/smollm2-135m-draft"],
     "not a head config"),
    (["--method", "medusa", "--head", f"{WEIGHTS}/smollm2-135m-eagle3"],
     "holds eagle3 heads, which only eagle, eagle2, eagle2+ngram, eagle3 draft with"),
    (["--model", "{good}", "--method", "eagle2"], "eagle"),          # heads of another model
    (["--model", "{good}", "--method", "block"], "--method block needs --head DIR, a block head"),
    (["--method", "block", "--tree-size", "4"], "--tree-size does not apply to --method block; "
     "it shapes medusa, eagle, eagle2, eagle2+ngram, eagle3, block (auto only)"),
    (["--model", "{good}", "--raw", "--prompt", " x" * 300], "longer than the model's context"),
    (["--model", "{good}", "--raw", "--prompt", ""], "the prompt is empty"),
    (["--model", "{small}"], "{small}: the tokenizer has 49152 tokens, the model's embedding 97"),
]

TRAIN_CASES = [
    (["--epochs", "0"], "--epochs must be > 0"),
    (["--held-out", "-1"], "--held-out must be >= 0"),
    (["--method", "lora"], "--method: invalid choice: 'lora'"),
    (["--device", "nosuchdevice"], "--device nosuchdevice is not available here"),
    (["--init", "/nonexistent"], "/nonexistent: no such folder"),
    (["--init", f"{WEIGHTS}/smollm2-135m-medusa"], "holds medusa heads; --method eagle"),
    (["--wise", "0.5"], "--wise 0.5: a weight in [0, 1] between an --init head"),
    (["--parallel", "4"], "--parallel 4: only a draft model and an EAGLE-3 head (--method draft,"),
    (["--parallel", "0"], "--parallel must be > 0"),
    (["--method", "draft", "--init", f"{WEIGHTS}/smollm2-135m-eagle3"], "holds eagle3 heads, not a"),
    (["--out", "/proc/x"], "--out /proc/x: cannot write there"),
    (["--data", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["--data", "{a file}"], "config.json:1: not JSON"),
]


EXPORT_CASES = [
    (["/nonexistent", "{out}/e"], "/nonexistent: no such folder"),
    ([f"{WEIGHTS}/smollm2-135m-medusa", "{out}/e"], "holds medusa heads; --format eagle exports"),
    ([f"{WEIGHTS}/smollm2-135m-draft", "{out}/e"], "not a head config"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", "{a file}"], "exists and is not a folder"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", "{good}"], "exists and is not empty; pass --force"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", "/proc/x/e"], "/proc/x/e: cannot write there"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", "{out}/e", "--format", "eagle3"],
     "head trained for hidden size 576 and vocab 49152, but the target has 64"),
    ([f"{WEIGHTS}/smollm2-135m-draft", "{out}/e", "--format", "hf"],
     "a draft of hidden size 576 and vocab 49152, but the target"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3"], "the following arguments are required: OUT"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", f"{WEIGHTS}/smollm2-135m-eagle3", "--force"],
     "holds the folder exported from"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", WEIGHTS, "--force"], "holds the folder exported from"),
    ([f"{WEIGHTS}/smollm2-135m-eagle3", ".", "--force"], "holds the folder exported from"),
]


def edit_json(path, **fields) -> None:
    """Rewrites a JSON file with fields set (None: removed)."""
    data = json.loads(path.read_text()) | fields
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def replay(main, argv, capsys) -> str:
    """Runs a command line -> its one stderr line; fails on any other exit or output."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, f"exit code {e.value.code} for {argv}: {err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{argv}:\n{err}"
    return lines[0]


def fill(text: str, folders: dict) -> str:
    return text.format(**folders) if "{" in text else text


def ids(cases) -> list:
    return [" ".join(flags)[:60] for flags, _ in cases]


@pytest.mark.parametrize("flags, message", SPEC_CASES, ids=ids(SPEC_CASES))
def test_spec_refuses_bad_input_in_one_line(flags, message, folders, capsys, tmp_path):
    from spec import main
    report = tmp_path / "report.json"
    argv = [fill(f, folders) for f in flags] + (["--json", str(report)]
                                                if "--json" not in flags else [])
    line = replay(main, argv + ["--max-new-tokens", "4"] if "--max-new-tokens" not in flags
                  else argv, capsys)
    assert fill(message, folders) in line
    assert not list(tmp_path.glob("report.json*")), "a report or its temporary file written"


@pytest.mark.parametrize("flags, message", TRAIN_CASES, ids=ids(TRAIN_CASES))
def test_train_heads_refuses_bad_input_in_one_line(flags, message, folders, capsys, tmp_path):
    import train_heads
    base = {"--method": "eagle", "--data": folders["a file"], "--out": str(tmp_path / "o"),
            "--model": folders["good"], "--stage": "features"}
    given = dict(zip(flags[::2], flags[1::2]))
    argv = [x for k, v in (base | given).items() for x in (k, fill(v, folders))]
    line = replay(train_heads.main, argv, capsys)
    assert fill(message, folders) in line
    assert not (tmp_path / "o").exists(), "--out made before the work it holds"


@pytest.mark.parametrize("flags, message", EXPORT_CASES, ids=ids(EXPORT_CASES))
def test_export_refuses_bad_input_in_one_line(flags, message, folders, capsys):
    import train_heads
    argv = ["export"] + [fill(f, folders) for f in flags]
    before = sorted(os.listdir(folders["out"]))
    fmt = [] if "--format" in flags else ["--format", "eagle"]
    line = replay(train_heads.main, argv + fmt + ["--model", folders["good"]], capsys)
    assert fill(message, folders) in line
    assert sorted(os.listdir(folders["out"])) == before, "export left something behind"


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    import spec
    import train_heads

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(spec, "run", interrupted)
    monkeypatch.setattr(train_heads, "train_command", interrupted)
    for main, argv in ((spec.main, []),
                       (train_heads.main, ["--method", "eagle", "--data", "d", "--out", "o"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 130 and "Traceback" not in err
        assert err.strip().splitlines()[0].startswith("interrupted"), err
        assert len(err.strip().splitlines()) == 1


def test_an_interrupted_bench_keeps_the_prompts_every_method_finished(capsys):
    from bench import BenchPrompt, decode_all
    from decode import Result
    prompts = [BenchPrompt(str(i), "c", [f"q{i}"]) for i in range(3)]
    calls = []

    def decoder(ids):
        calls.append(ids)
        if len(calls) == 6:                         # prompt 2, the second method
            raise KeyboardInterrupt
        return Result([1, 2], 2, 0.1)

    class Tok:
        stop_ids = ()
        chat_ids = staticmethod(lambda turns: [len(turns)])
        decode = staticmethod(lambda ids: "x")
    decoders = {(0.0, "ar"): decoder, (0.0, "ngram"): decoder}
    records, interrupted = decode_all(prompts, decoders, Tok())
    assert interrupted and [(r.id, r.method) for r in records] == [("0", "ar"), ("0", "ngram"),
                                                                   ("1", "ar"), ("1", "ngram")]
    assert "the tables count the 2 prompts every method finished" in capsys.readouterr().err
    calls.clear()
    calls.extend([None] * 4)                        # the very first prompt is cut
    with pytest.raises(KeyboardInterrupt):
        decode_all(prompts, decoders, Tok())


def test_a_killed_conversion_leaves_no_work_folder_behind(tmp_path):
    import time
    from default_model import STALE_SECONDS, remove_stale_work
    old, new, other = tmp_path / ".convert-old", tmp_path / ".convert-new", tmp_path / "keep"
    for folder in (old, new, other):
        folder.mkdir()
        (folder / "partial.gguf").write_bytes(b"x")
    gone = time.time() - STALE_SECONDS - 60
    for path in (old / "partial.gguf", old, new, other / "partial.gguf", other):
        os.utime(path, (gone, gone))      # new's download still grows its file
    remove_stale_work(str(tmp_path))
    assert not old.exists(), "a conversion killed midway is cleaned up at the next start"
    assert new.exists() and other.exists(), "one running now, and other folders, are left alone"


def test_json_file_of_a_run_is_written_whole(tmp_path, monkeypatch, capsys):
    import spec
    report = {"method": "ar", "new_tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0,
              "target_forwards": 1, "tau": 1.0}
    monkeypatch.setattr(spec, "run", lambda args: report)
    spec.main(["--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert sorted(os.listdir(tmp_path)) == ["r.json"]
    captured = capsys.readouterr()
    assert captured.out == "" and "[ar] 1 tokens" in captured.err


def test_the_repository_root_holds_only_the_projects_own_files():
    """A stray committed or left beside the code (a coverage file, a run's --json report named
    like a prompt) fails here: the root holds the code, its docs and a few named files."""
    import fnmatch
    import subprocess
    root = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isdir(os.path.join(root, ".git")):
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, text=True, check=True).stdout.split("\0")
    allowed = ("*.py", "*.md", ".gitignore", "pytest.ini", "requirements.txt", "gpu_check.sh",
               ".ci/*", "docs/*", "weights/*")
    strays = [f for f in listed if f and os.path.exists(os.path.join(root, f))
              and not any(fnmatch.fnmatch(f, pattern) for pattern in allowed)]
    assert not strays, f"files that are not the project's at its root: {strays}"
