"""The benchmark behind `python spec.py --bench PROMPTS.jsonl --methods ar,eagle2,...`.

Every method decodes the same prompts in the same order in one process, interleaved prompt by
prompt, after a warm-up, so every speedup is a ratio of times measured side by side. Multi-turn
prompts (Spec-Bench's `turns`) continue each method's own conversation.
"""
import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from spec import jsonl_rows


@dataclass
class BenchPrompt:
    id: str
    category: str
    turns: list


@dataclass
class Record:
    method: str
    id: str
    category: str
    turn: int
    token_ids: list
    target_forwards: int
    seconds: float
    accepted: list = field(default_factory=list)    # per step: drafted tokens accepted


def read_bench(path: str, limit: int = 0, categories: str | None = None,
               per_category: int = 0) -> list:
    """JSONL lines {prompt} or {turns: [...]}, optional {category, question_id|id}; the first
    `per_category` of each category (0: all), at most `limit` in all (0: all)."""
    wanted = set(categories.split(",")) if categories else None
    prompts, seen = [], {}
    for number, row in jsonl_rows(path):
        try:
            turns = [row["prompt"]] if "prompt" in row else row["turns"]
            if not isinstance(turns, list) or not turns or \
                    not all(isinstance(t, str) for t in turns):
                raise TypeError("turns must be a non-empty list of strings")
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: expected a JSON object with 'prompt' (a "
                             f"string) or 'turns' (a list of strings): {e}") from None
        category = str(row.get("category", "all"))
        seen[category] = seen.get(category, 0) + 1
        if (wanted is None or category in wanted) and \
                (not per_category or seen[category] <= per_category):
            prompts.append(BenchPrompt(str(row.get("question_id", row.get("id", number))),
                                       category, turns))
        if limit and len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts" + (f" in categories {categories}" if wanted else ""))
    return prompts


def summarize(records: list, methods: list, extra_mb: dict, target_mb: float) -> dict:
    """Headline, per-category and per-position numbers from the records of one run."""
    def totals(rs):
        new = sum(len(r.token_ids) for r in rs)
        return new, sum(r.target_forwards for r in rs), sum(r.seconds for r in rs)

    out = {"methods": {}, "categories": {}}
    base = totals([r for r in records if r.method == methods[0]])
    for m in methods:
        new, fwd, sec = totals([r for r in records if r.method == m])
        steps = [a for r in records if r.method == m for a in r.accepted]
        depth = max(steps, default=0)
        out["methods"][m] = {
            "tau": new / max(fwd, 1), "tokens_per_s": new / max(sec, 1e-9),
            "speedup": (new / max(sec, 1e-9)) / (base[0] / max(base[2], 1e-9)),
            "memory_mb": extra_mb.get(m, 0.0), "memory_pct": 100 * extra_mb.get(m, 0.0) / target_mb,
            "acceptance_by_position": [sum(a > i for a in steps) / max(len(steps), 1)
                                       for i in range(depth)],
            "identical": identical(records, methods[0], m)}
    for c in sorted({r.category for r in records}):
        rs = [r for r in records if r.category == c]
        b = totals([r for r in rs if r.method == methods[0]])
        out["categories"][c] = {}
        for m in methods:
            new, fwd, sec = totals([r for r in rs if r.method == m])
            out["categories"][c][m] = {"tau": new / max(fwd, 1),
                                       "speedup": (new / max(sec, 1e-9)) / (b[0] / max(b[2], 1e-9))}
    return out


def identical(records: list, base: str, method: str) -> list:
    """[identical, compared]: outputs token-identical to the baseline's on the same turn."""
    ref = {(r.id, r.turn): r.token_ids for r in records if r.method == base}
    mine = [(r.id, r.turn, r.token_ids) for r in records if r.method == method]
    return [sum(ref.get((i, t)) == ids for i, t, ids in mine), len(mine)]


def format_tables(summary: dict, methods: list) -> str:
    lines = [f"{'method':<10}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'+MB':>8}{'+%':>7}"
             f"{'identical':>11}"]
    for m, s in summary["methods"].items():
        lines.append(f"{m:<10}{s['tau']:7.2f}{s['tokens_per_s']:9.1f}{s['speedup']:8.2f}x"
                     f"{s['memory_mb']:8.1f}{s['memory_pct']:6.1f}%"
                     f"{s['identical'][0]:>6}/{s['identical'][1]}")
    lines += ["", "tau / speedup per category", f"{'category':<16}" +
              "".join(f"{m:>16}" for m in methods)]
    for c, per in summary["categories"].items():
        lines.append(f"{c:<16}" + "".join(f"{per[m]['tau']:9.2f} {per[m]['speedup']:4.2f}x"
                                           for m in methods))
    lines += ["", "acceptance by draft position (fraction of steps)"]
    for m, s in summary["methods"].items():
        if s["acceptance_by_position"]:
            lines.append(f"{m:<10}" + " ".join(f"{a:.2f}" for a in s["acceptance_by_position"]))
    return "\n".join(lines)


@torch.inference_mode()
def run_bench(args, build) -> dict:
    """build(method) -> (decode(prompt_ids) -> spec.Result, added MB). Returns the JSON report."""
    from spec import load_target
    path, target, tokenizer = load_target(args)
    methods = args.methods.split(",")
    if methods[0] != "ar":
        methods = ["ar"] + [m for m in methods if m != "ar"]     # the baseline runs first
    prompts = read_bench(args.bench, args.limit, args.categories, args.per_category)
    decoders, extra_mb = {}, {}
    for m in methods:
        decoders[m], extra_mb[m] = build(m, target, tokenizer)
        decoders[m](tokenizer.chat_prompt("Hello! Say something."))       # warm-up
    records = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr)
    for p in prompts:
        for m in methods:
            history = []
            for turn, text in enumerate(p.turns):
                ids = tokenizer.chat_ids(history + [("user", text)])
                r = decoders[m](ids)
                records.append(Record(m, p.id, p.category, turn, r.token_ids, r.target_forwards,
                                      r.seconds, r.accepted))
                answer = [t for t in r.token_ids if t not in tokenizer.stop_ids]
                history += [("user", text), ("assistant", tokenizer.decode(answer))]
            bar.update(1)
    bar.close()
    target_mb = sum(p.numel() * p.element_size() for p in target.parameters()) / 2**20
    summary = summarize(records, methods, extra_mb, target_mb)
    print(format_tables(summary, methods), file=sys.stderr)
    return {"model_path": path, "dtype": args.dtype, "device": args.device,
            "prompts": args.bench, "count": len(prompts), "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "summary": summary,
            "records": [r.__dict__ for r in records]}
