"""The benchmark behind `python spec.py --bench PROMPTS.jsonl --methods ar,eagle2,...`.

Every method decodes the same prompts in the same order in one process, interleaved prompt by
prompt, after a warm-up, so every speedup is a ratio of times measured side by side. Multi-turn
prompts (Spec-Bench's `turns`) continue each method's own conversation.
"""
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from checkpoint import write_whole
from decode import PHASES, GenConfig, Result, acceptance_by_position
from costs import forward_costs
from export import export_draft
from methods import TargetConfig, draft_folder, load_target, module_bytes


COMPILED = "+compile"                # --bench --compile: the compiled twin of each method


@dataclass
class BenchConfig:
    """What one bench run decodes, and with what (spec.py's --bench flags)."""
    prompts: str                        # a JSONL file: {prompt} or {turns}, optional category
    methods: list                       # plain decoding ("ar") runs first, as the baseline
    target: TargetConfig
    temperatures: list = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 128
    top_p: float = 1.0
    seed: int = 0
    limit: int = 10                     # prompts in all (0: every one selected)
    categories: str | None = None       # comma-separated (None: all)
    per_category: int = 0               # the first N prompts of each category (0: all)
    compile: bool = False               # every method also compiled (METHOD+compile rows)
    peers: bool = False                 # transformers' own decoders too (PEERS)
    draft: str | None = None            # the assistant of hf-assisted (None: the shipped draft)
    plot: str | None = None             # a folder for PNG plots of the run (matplotlib)


def jsonl_rows(path: str):
    """(line number, object) for each non-empty line; a line that is not JSON names its number."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"JSONL file not found: {path}")
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not JSON ({e})") from None


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
    temperature: float = 0.0
    phase_seconds: dict = field(default_factory=dict)   # of `seconds`, by phase (decode.PHASES)
    depths: list = field(default_factory=list)      # per step: the tree's depth
    drafted: list = field(default_factory=list)     # per step: the tree's nodes


def read_bench(path: str, limit: int = 0, categories: str | None = None,
               per_category: int = 0) -> list:
    """JSONL lines {prompt} or {turns: [...]}, optional {category, question_id|id}; the first
    `per_category` of each category (0: all), at most `limit` in all (0: all)."""
    wanted = set(categories.split(",")) if categories else None
    prompts, seen = [], {}
    for number, row in jsonl_rows(path):
        try:
            turns = [row["prompt"]] if "prompt" in row else row["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise TypeError("turns must be a non-empty list of strings")
        except (KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected a JSON object with 'prompt' (a "
                             f"string) or 'turns' (a list of strings)") from None
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


def summarize(records: list, methods: list, extra_mb: dict, target_mb: float,
              configs: dict | None = None) -> dict:
    """Headline, per-category and per-position numbers from the records of one run."""
    def totals(rs):
        new = sum(len(r.token_ids) for r in rs)
        return new, sum(r.target_forwards for r in rs), sum(r.seconds for r in rs)

    out = {"methods": {}, "categories": {}}
    base = totals([r for r in records if r.method == methods[0]])
    base_ms = 1000 * base[2] / max(base[1], 1)
    for m in methods:
        new, fwd, sec = totals([r for r in records if r.method == m])
        steps = [a for r in records if r.method == m for a in r.accepted]
        depths = [d for r in records if r.method == m for d in r.depths]
        # tokens/s = tau / (s per forward), so speedup = tau x base_ms / ms: what a method's
        # forward costs (drafting included) sets the tau it needs for a given speedup
        ms = 1000 * sec / max(fwd, 1)
        phases = {p: sum(r.phase_seconds.get(p, 0.0) for r in records if r.method == m)
                  for p in PHASES}
        out["methods"][m] = {
            "config": (configs or {}).get(m, ""),
            "tau": new / max(fwd, 1), "tokens_per_s": new / max(sec, 1e-9),
            "speedup": (new / max(sec, 1e-9)) / (base[0] / max(base[2], 1e-9)),
            "ms_per_forward": ms,
            "draft_ms_per_step": 1000 * phases["draft"] / len(steps) if steps else None,
            "phase_ms_per_step": {p: 1000 * s / len(steps) for p, s in phases.items()}
            if steps else None,
            "tau_for_2x": 2 * ms / base_ms,
            "memory_mb": extra_mb.get(m, 0.0), "memory_pct": 100 * extra_mb.get(m, 0.0) / target_mb,
            "acceptance_by_position": acceptance_by_position(Result(accepted=steps,
                                                                    depths=depths)),
            # compiled: against compiled plain decoding, whose rounding it shares
            "identical": identical(records, methods[0] + COMPILED * m.endswith(COMPILED), m)}
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
    wide = max([28] + [len(s["config"]) + 2 for s in summary["methods"].values()])
    lines = [f"{'method':<21}{'configuration':<{wide}}{'tau':>6}{'tok/s':>9}{'speedup':>9}"
             f"{'+MB':>8}{'+%':>7}{'identical':>11}"]
    for m, s in summary["methods"].items():
        lines.append(f"{m:<21}{s['config']:<{wide}}{s['tau']:6.2f}{s['tokens_per_s']:9.1f}"
                     f"{s['speedup']:8.2f}x{s['memory_mb']:8.1f}{s['memory_pct']:6.1f}%"
                     f"{s['identical'][0]:>6}/{s['identical'][1]}")
    width = {m: max(16, len(m) + 2) for m in methods}          # a column per method
    lines += ["", "tau / speedup per category", f"{'category':<16}" +
              "".join(f"{m:>{width[m]}}" for m in methods)]
    for c, per in summary["categories"].items():
        lines.append(f"{c:<16}" + "".join(
            f"{per[m]['tau']:{width[m] - 6}.2f} {per[m]['speedup']:4.2f}x" for m in methods))
    lines += ["", "ms per target forward, drafting included (speedup = tau x the baseline's ms "
              "/ this ms), and a step's phases (decode.PHASES)",
              f"{'method':<21}{'ms':>8}{'tau for 2x':>12}" + "".join(f"{p:>9}" for p in PHASES)]
    for m, s in summary["methods"].items():
        phases = s["phase_ms_per_step"] or {}
        lines.append(f"{m:<21}{s['ms_per_forward']:8.1f}{s['tau_for_2x']:12.2f}" + "".join(
            f"{'-' if p not in phases else format(phases[p], '.1f'):>9}" for p in PHASES))
    lines += ["", "acceptance by draft position (fraction of steps)"]
    for m, s in summary["methods"].items():
        if s["acceptance_by_position"]:
            lines.append(f"{m:<21}" + " ".join(f"{a:.2f}" for a in s["acceptance_by_position"]))
    return "\n".join(lines)


@torch.inference_mode()
def run_bench(bc: BenchConfig, build, loaded: tuple, out=sys.stdout) -> dict:
    """build(method, loaded, GenConfig, most slots a prompt needs) -> (decode(prompt_ids) ->
    decode.Result, added MB, configuration in words); loaded: (model path, target, tokenizer).

    One run per temperature of bc.temperatures, each with its own baseline. Returns the JSON
    report; the tables go to `out`, the progress to stderr."""
    path, target, tokenizer = loaded
    methods = ["ar"] + [m for m in bc.methods if m != "ar"]       # the baseline runs first
    if bc.compile:
        methods += [m + COMPILED for m in methods]
    if bc.peers:
        methods += PEERS
    prompts = read_bench(bc.prompts, bc.limit, bc.categories, bc.per_category)
    turns = sum(len(p.turns) for p in prompts)
    print(f"bench: {len(prompts)} prompts ({turns} turns) from {bc.prompts}, categories "
          f"{', '.join(dict.fromkeys(p.category for p in prompts))}", file=sys.stderr)
    decoders, extra_mb, configs, hf_models = {}, {}, {}, {}
    # the most cache slots a conversation needs: its turns' text and every answer in full
    longest = max(len(tokenizer.chat_ids([("user", "\n\n".join(p.turns))]))
                  + len(p.turns) * (bc.max_new_tokens + 16) for p in prompts)
    for T in bc.temperatures:
        gen = GenConfig(bc.max_new_tokens, T, bc.top_p, bc.seed)
        for m in methods:
            made = (peer_decoder(bc, m, loaded, gen, hf_models) if m in PEERS else
                    build(m, loaded, gen, longest))
            decoders[T, m], extra_mb[m], configs[m] = made
            decoders[T, m](tokenizer.chat_prompt("Hello! Say something."))       # warm-up
    records, interrupted = decode_all(prompts, decoders, tokenizer)
    target_mb = module_bytes(target) / 2**20          # quantized weights are buffers
    runs = []
    for T in bc.temperatures:
        summary = summarize([r for r in records if r.temperature == T], methods, extra_mb,
                            target_mb, configs)
        print(f"\n== temperature {T:g}\n" + format_tables(summary, methods), file=out)
        runs.append({"temperature": T, "summary": summary})
    if len(runs) > 1:
        print("\n" + format_temperatures(runs, methods), file=out)
    if bc.plot:
        plots(bc.plot, runs, methods, forward_costs(target, PLOT_SIZES, repeats=3))
        print(f"plots written to {bc.plot}", file=sys.stderr)
    return {"model_path": path, "dtype": bc.target.dtype, "device": bc.target.device,
            "prompts": bc.prompts, "count": len({r.id for r in records}), "runs": runs,
            "max_new_tokens": bc.max_new_tokens, "interrupted": interrupted,
            "records": [r.__dict__ for r in records]}


PLOT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)     # tokens a verify pass, plotted


def plots(folder: str, runs: list, methods: list, cost_ms: dict) -> None:
    """PNG pictures of a bench in folder: a verify pass's cost against its tree size,
    acceptance by draft position per method, and (several temperatures) tau against
    temperature. matplotlib is imported here only: nothing else needs it."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")                               # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    def save(name: str, lines: dict, integer=False, **labels) -> None:   # {label: (x, y)}
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, (x, y) in lines.items():
            ax.plot(x, y, marker="o", label=label)
        ax.set(**labels)
        if integer:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if None not in lines:
            ax.legend()
        fig.tight_layout()                        # whole (a temporary name, then renamed)
        write_whole(os.path.join(folder, name), lambda tmp: fig.savefig(tmp, format="png", dpi=110))
        plt.close(fig)
    os.makedirs(folder, exist_ok=True)
    save("verify_cost.png", {None: (list(cost_ms), [ms / cost_ms[1] for ms in cost_ms.values()])},
         xlabel="tokens in one target forward (tree nodes + root)",
         ylabel="cost relative to 1 token", title="What verifying a tree costs")
    acc = {m: runs[0]["summary"]["methods"][m].get("acceptance_by_position") for m in methods}
    save("acceptance.png", {m: (range(1, len(a) + 1), a) for m, a in acc.items() if a}, True,
         xlabel="draft position", ylabel="fraction of steps accepted", ylim=(0, 1),
         title=f"Acceptance by position (temperature {runs[0]['temperature']:g})")
    if len(runs) > 1:
        save("tau_by_temperature.png", {m: ([r["temperature"] for r in runs], [
            r["summary"]["methods"][m]["tau"] for r in runs]) for m in methods},
             xlabel="temperature", ylabel="tau (tokens per target forward)",
             title="Acceptance falls as sampling spreads")


def decode_all(prompts: list, decoders: dict, tokenizer) -> tuple:
    """Every decoder on every prompt, prompt by prompt -> (records, interrupted). Ctrl-C keeps
    the prompts that every decoder finished (KeyboardInterrupt again when there are none)."""
    records, done = [], 0                          # done: records of the finished prompts
    bar = tqdm(total=len(prompts) * len(decoders), desc="bench", unit="run", file=sys.stderr)
    try:
        for p in prompts:
            done = len(records)
            for (T, m), decode in decoders.items():
                history = []
                for turn, text in enumerate(p.turns):
                    ids = tokenizer.chat_ids(history + [("user", text)])
                    r = decode(ids)
                    records.append(Record(m, p.id, p.category, turn, r.token_ids,
                                          r.target_forwards, r.seconds, r.accepted, T,
                                          {ph: sum(s) for ph, s in r.phase_seconds.items()},
                                          r.depths, r.drafted))
                    answer = [t for t in r.token_ids if t not in tokenizer.stop_ids]
                    history += [("user", text), ("assistant", tokenizer.decode(answer))]
                bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        if not done:
            raise
        print(f"interrupted: the tables count the {len({r.id for r in records[:done]})} "
              "prompts every method finished", file=sys.stderr)
        return records[:done], True
    bar.close()
    return records, False


def format_temperatures(runs: list, methods: list) -> str:
    """tau and speedup of each method at each temperature, one line per method."""
    lines = ["tau / speedup by temperature", f"{'method':<21}" +
             "".join(f"{'T=' + format(r['temperature'], 'g'):>16}" for r in runs)]
    for m in methods:
        lines.append(f"{m:<21}" + "".join(
            f"{r['summary']['methods'][m]['tau']:10.2f} {r['summary']['methods'][m]['speedup']:4.2f}x"
            for r in runs))
    return "\n".join(lines)


# ---------------------------------------------------------------- peers: transformers

PEERS = ["hf", "hf-ngram", "hf-assisted"]


def peer_decoder(bc: BenchConfig, name: str, loaded: tuple, gen: GenConfig,
                 hf_models: dict) -> tuple:
    """transformers' generate on the same model folder, dtype and prompts: plain ("hf"), with
    prompt lookup ("hf-ngram", prompt_lookup_num_tokens=10 as in its docs) or assisted by our
    distilled draft ("hf-assisted"). hf_models: the models loaded so far, shared by every peer
    and temperature of a bench."""
    path, _, tokenizer = loaded
    dtype, device = getattr(torch, bc.target.dtype), bc.target.device
    hf, calls = hf_model(path, dtype, device, hf_models)
    options = {"max_new_tokens": gen.max_new_tokens, "eos_token_id": list(tokenizer.stop_ids),
               "pad_token_id": tokenizer.stop_ids[0]}
    options |= ({"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p}
                if gen.temperature > 0 else {"do_sample": False, "temperature": None,
                                              "top_p": None, "top_k": None})
    extra_mb = 0.0
    if name == "hf-ngram":
        options["prompt_lookup_num_tokens"] = 10
    elif name == "hf-assisted":
        with tempfile.TemporaryDirectory() as tmp:      # a whole HF folder, for transformers
            folder = os.path.join(tmp, "draft")
            export_draft(draft_folder(bc.draft), path, folder)
            # its own copy: generate() adapts the assistant's draft length in its generation_config
            helper = hf_model(folder, dtype, device, {})[0]
        options["assistant_model"] = helper
        extra_mb = sum(p.numel() * p.element_size() for p in helper.parameters()) / 2**20

    def decode(prompt_ids):
        torch.manual_seed(gen.seed)
        calls[0] = 0
        t0 = time.perf_counter()
        out = hf.generate(torch.tensor([prompt_ids], device=device), **options)
        new = out[0, len(prompt_ids):].tolist()                    # (waits for the device)
        seconds = time.perf_counter() - t0
        stop = next((i for i, t in enumerate(new) if t in tokenizer.stop_ids), None)
        return Result(token_ids=new if stop is None else new[:stop + 1],
                      target_forwards=calls[0], seconds=seconds)
    config = {"hf": "generate, plain", "hf-ngram": "prompt lookup, 10 tokens",
              "hf-assisted": "distilled draft"}[name]
    return decode, extra_mb, config


def hf_model(folder: str, dtype, device: str, loaded: dict) -> tuple:
    """transformers' model of folder, loaded once into `loaded` -> (model, [its forwards so far],
    counted by a hook; a decoder sets it to 0 before it runs)."""
    if folder not in loaded:
        try:
            import transformers
        except ImportError:
            raise ValueError("--peers needs transformers: pip install transformers") from None
        # its loading bars and notes (one on generate's own arguments, with an assistant)
        # would break into the bench's lines
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        calls = [0]
        hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        loaded[folder] = hf, calls
    return loaded[folder]


# ---------------------------------------------------------------- --verify-curve

@torch.inference_mode()
def verify_curve(tc: TargetConfig) -> dict:
    """Cost of one target forward over k new tokens per row, relative to one token, at batch 1
    (k up to 512) and batch 8 (8 x k up to 512): where verifying stops being free."""
    path, model, _ = load_target(tc)
    curves = {1: forward_costs(model, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
              8: forward_costs(model, (1, 2, 4, 8, 16, 32, 64), batch=8)}
    base = curves[1][1]
    print(f"{machine_name(tc.device)}, {tc.dtype}, {os.path.basename(path)}\n"
          f"{'batch':>5}{'k':>5}{'tokens':>8}{'ms':>9}{'vs 1 token':>12}{'ms/token':>10}",
          file=sys.stderr)
    for batch, ms in curves.items():
        for k, t in ms.items():
            print(f"{batch:5d}{k:5d}{batch * k:8d}{t:9.1f}{t / base:11.2f}x{t / (batch * k):10.2f}",
                  file=sys.stderr)
    return {"machine": machine_name(tc.device), "dtype": tc.dtype, "device": tc.device,
            "model": path, "ms": {f"{b}x{k}": t for b, ms in curves.items() for k, t in ms.items()}}


def machine_name(device: str) -> str:
    """The CPU's (or GPU's) name and the thread count, for the reports."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name} x{torch.get_num_threads()}"
