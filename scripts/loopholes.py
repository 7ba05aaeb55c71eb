"""The shapes world's judge, read as a person would: which of its verdicts on trained models' samples a person would
overturn. Samples the held-out prompts from the base model and from checkpoints (ODE, the preset's steps, each
prompt `--samples` times on seeded noise), judges every image, and sorts the images the judge calls correct by what
a person could object to:

    extra of an asked class   more shapes of a class the prompt names than it asks for (GenEval's rule accepts them
                              outside counting prompts: "a photo of a circle" with two circles is correct)
    extra of another class    shapes of a class the prompt does not name (accepted by GenEval's rule everywhere)
    unnamed component         a component the detector cannot name (a blob, a bar, a speck) beside the asked shapes
    faint match               an asked shape that scores 0.3-0.5: does a person see that shape?
    GenEval's rule differs    GenEval's own rule (0.9 for counting, unnamed components ignored) says otherwise

and writes loopholes.json (counts per weights, tag and kind, out of the images judged correct) and a grid per kind
(loopholes-<kind>.png: examples from the last checkpoint, each captioned with its prompt and what was found); with
--ledger and --name, the counts also go into the page's ledger (a row per weights and tag, set `loopholes`, run NAME),
in place of that name's rows. --report prints docs/judge.md's table of named searches again from the ledger.

    python scripts/loopholes.py runs/default/checkpoints/100 [more checkpoints] --out runs/loopholes
    python scripts/loopholes.py runs/default/checkpoints/100 --ledger docs/runs/judge.jsonl --name honest
    python scripts/loopholes.py --report gamed honest long --ledger docs/runs/judge.jsonl
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import eval as evaluation  # noqa: E402
import families  # noqa: E402
import flags  # noqa: E402
import geneval  # noqa: E402
import models  # noqa: E402
import shapes  # noqa: E402
import ledgers  # noqa: E402

KINDS = ("extra of an asked class", "extra of another class", "unnamed component", "faint match",
         "GenEval's rule differs")
FAINT = 0.5


def objections(metadata, detections):
    """What a person could object to in an image of `metadata` -> (judge's verdict, [kinds], a short note)."""
    verdict = geneval.geneval_judge(metadata, detections, counting_threshold=shapes.COUNTING_THRESHOLD)
    kept = geneval.kept_detections(detections, metadata["tag"], counting_threshold=shapes.COUNTING_THRESHOLD)
    asked = {c["class"]: c["count"] for c in metadata["include"]}
    found = []
    if any(len(kept.get(name, [])) > count for name, count in asked.items()):
        found.append(KINDS[0])
    if any(name not in asked for name in kept):
        found.append(KINDS[1])
    if verdict["unexplained"]:
        found.append(KINDS[2])
    if any(d["score"] <= FAINT for name, count in asked.items() for d in kept.get(name, [])[:count]):
        found.append(KINDS[3])
    if verdict["official"] != verdict["correct"]:
        found.append(KINDS[4])
    note = ", ".join(f"{len(v)} {k}" for k, v in kept.items()) + (f", {verdict['unexplained']} unnamed"
                                                                      if verdict["unexplained"] else "")
    return verdict["correct"], found, note


def sample(pipe, prompts, samples, seed, steps):
    """Each prompt `samples` times, sample r of prompt i on noise index r * len(prompts) + i -> uint8 [N * r, ...]."""
    every = [p for _ in range(samples) for p in prompts]
    preset = families.preset("shapes")
    return evaluation.sample_images(pipe, every, resolution=preset["resolution"], num_steps=steps,
                                    guidance_scale=preset["guidance_scale"], seed=seed, batch_size=64)


def page_table(rows, names):
    """docs/judge.md's table of the searches `names` from the ledger's rows: a line per tag, the base's count then
    each search's last weights', for the judged correct and each kind the page shows."""
    runs = ledgers.runs([r for r in rows if r.get("set") == "loopholes"])
    missing = [name for name in names if name not in runs]
    if missing:
        held = f"its searches are {', '.join(sorted(runs))}" if runs else "it holds none"
        raise SystemExit(f"error: the ledger holds no search {', '.join(missing)}: {held}")
    def counts(name, base):
        mine = [r for r in runs[name] if (r["weights"] == "base") == base]
        weights = mine[-1]["weights"]  # the last weights searched
        return {r["tag"]: r for r in mine if r["weights"] == weights}
    columns = [counts(names[0], True)] + [counts(name, False) for name in names]
    shown = ["correct", *KINDS[:4]]
    lines = ["| tag | weights | correct | extra of an asked class | extra of another class | unnamed component | "
             "faint match (0.3-0.5) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for tag in shapes.TAGS:
        lines.append(f"| {tag} | {' / '.join(['base', *names])} | "
                     + " | ".join(" / ".join(str(c[tag][k]) for c in columns) for k in shown) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="train.py checkpoints of the shapes model (<run>/checkpoints/<step>)")
    p.add_argument("--prompts", default="prompts/shapes_test.jsonl", help="held-out GenEval rows of the shapes world")
    p.add_argument("--samples", type=flags.POSITIVE_INT, default=4, help="images per prompt")
    p.add_argument("--seed", type=flags.SEED, default=7, help="noise seed")
    p.add_argument("--steps", type=flags.POSITIVE_INT, default=10, help="ODE steps")
    p.add_argument("--per-grid", type=flags.POSITIVE_INT, default=24, help="examples in each kind's grid")
    p.add_argument("--out", default="runs/loopholes", help="folder of loopholes.json and the grids")
    p.add_argument("--ledger", default=None, help="the page's ledger (docs/runs/judge.jsonl): the counts go there "
                   "under --name; --report reads it")
    p.add_argument("--name", default=None, help="the search's name in --ledger")
    p.add_argument("--report", nargs="+", metavar="NAME", help="print the table of these searches of --ledger, and "
                   "exit")
    args = p.parse_args(argv)
    if args.report:
        if not args.ledger:
            p.error("--report reads --ledger: give it, such as --ledger docs/runs/judge.jsonl")
        return args
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file, not a folder: give a folder for loopholes.json and the grids")
    if bool(args.ledger) != bool(args.name):
        p.error("--ledger and --name go together: the counts are written to the ledger under the name")
    if args.ledger and os.path.isdir(args.ledger):
        p.error(f"--ledger {args.ledger} is a folder: give the ledger's file, such as docs/runs/judge.jsonl")
    if args.ledger and os.path.exists(args.ledger):
        ledgers.read(args.ledger)  # a damaged ledger is refused before any sampling
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        text = page_table(ledgers.read(args.ledger), args.report)
        print(text, end="")
        return text
    prompts, metadata = data.load_prompts(args.prompts, input_key="prompt")
    pipe = models.load_pipeline("shapes")
    base = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    os.makedirs(args.out, exist_ok=True)
    report, examples = {}, {}
    for name in ["base"] + args.checkpoints:
        pipe.transformer.load_state_dict(base)
        if name != "base":
            evaluation.load_weights(pipe, name, use_ema=True)
        with torch.no_grad():
            images = sample(pipe, prompts, args.samples, args.seed, args.steps)
        rows = [(prompts[i % len(prompts)], metadata[i % len(prompts)]) for i in range(len(images))]
        table = {tag: dict(images=0, correct=0, official=0, **{k: 0 for k in KINDS}) for tag in shapes.TAGS}
        examples = {k: [] for k in KINDS}
        for image, (prompt, meta), dets in zip(images.numpy(), rows, shapes.detect(images.numpy())):
            correct, found, note = objections(meta, dets)
            entry = table[meta["tag"]]
            entry["images"] += 1
            entry["correct"] += int(correct)
            entry["official"] += int(geneval.geneval_judge(meta, dets)["official"])
            for kind in found:
                if correct or kind == KINDS[4]:
                    entry[kind] += 1
                    examples[kind].append((image, f"{prompt}\n{'correct' if correct else 'wrong'}: {note}"))
        report[name] = table
        print(name, {tag: f"{t['correct']}/{t['images']} correct, " + ", ".join(
            f"{t[k]} {k}" for k in KINDS if t[k]) for tag, t in table.items()})
    with open(os.path.join(args.out, "loopholes.json"), "w") as f:
        json.dump(report, f, indent=1)
    if args.ledger:
        command = f"python scripts/loopholes.py {' '.join(sys.argv[1:] if argv is None else argv)}"
        rows = [{"set": "loopholes", "run": args.name, "weights": weights, "tag": tag, **counts}
                for weights, by_tag in report.items() for tag, counts in by_tag.items()]
        rows[0]["command"] = command
        ledgers.replace(args.ledger, rows, key=("set", "run"))
    for i, kind in enumerate(KINDS):  # the last weights' examples, spread over the list
        chosen = examples[kind][::max(1, len(examples[kind]) // args.per_grid)][:args.per_grid]
        if chosen:
            rows = [evaluation.captioned_row(np.stack([im for im, _ in chosen[j:j + 8]]),
                                             [c for _, c in chosen[j:j + 8]]) for j in range(0, len(chosen), 8)]
            from PIL import Image
            grid = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
            for j, r in enumerate(rows):
                grid.paste(r, (0, sum(x.height for x in rows[:j])))
            grid.save(os.path.join(args.out, f"loopholes-{i + 1}.png"))
    print(f"wrote {args.out}/loopholes.json and a grid per kind (loopholes-1.png .. -{len(KINDS)}.png: "
          + "; ".join(f"{i + 1} {k}" for i, k in enumerate(KINDS)) + ")" + (f"; its rows into {args.ledger}"
                                                                            if args.ledger else ""))


if __name__ == "__main__":
    main()
