"""Train the learned proxy of the shapes world's GenEval judge (shapes/proxy.py): a small network that predicts, from a
32 px image and its prompt's metadata, whether the exact judge (`--reward geneval --geneval-detector shapes`, its
official 0/1 `geneval_correct`, the held-out accuracy of docs/shapes.md) calls the image correct.

    python scripts/train_shapes_proxy.py           # writes weights/shapes_proxy.safetensors (3 members)
    python scripts/train_shapes_proxy.py --renders 1000 --samples 0 --held-out-samples 0 --steps 300 \\
        --ensemble 1 --out /tmp/proxy.safetensors         # a quick look (about 2 minutes)

The training set comes from the training prompts (prompts/shapes_train.jsonl) only:

1. rendered scenes (shapes.render): a third drawn from the prompt's own metadata, the rest from a perturbed copy of
   it, one perturbation each (`perturb`): another class, another count, another colour, another relation, an object
   missing, the two objects' classes swapped (the colour-attribution and relation negatives), an extra object, or
   a random scene of the world;
2. samples of the pretrained shapes model (models.py `shapes`, weights/shapes.safetensors) for the training prompts:
   eval.py's 10-step Euler ODE at CFG 1, each on its own seeded noise. These are the images RL starts from, blurry and
   often wrong (about a third correct), which rendered scenes do not look like.

Every image is labelled by the exact judge on the prompt's metadata (whatever it was drawn from: a perturbed scene
can still be correct, e.g. an extra object in "a circle and a square"), and the judge's detections draw the maps the
network learns beside the verdict (class and colour per cell, a density bump per kept object: `judge`, shapes/proxy.py).
Each member of the ensemble trains from its own seed (--seed + k: initial weights and batch order) on the same
labelled set: the verdict's logistic loss plus the maps' losses, Adam, a cosine learning rate.

Held out: the test prompts (prompts/shapes_test.jsonl, none of them a training prompt; every single-object prompt is
there): one rendered scene of each row's own metadata and two perturbed ones (1,080 scenes), and the shapes model's
sample of each row on eval.py's noise (seed 0: the images of the base model's held-out evaluation in train.py), each
labelled by the judge. The script reports each member's and the ensemble mean's agreement with the judge (P > 0.5
against the 0/1 verdict): accuracy overall and per tag on the renders, and on the model's samples the accuracy, the
share the judge calls correct (the accuracy of always answering "wrong" is one minus it) and the balanced accuracy
(the mean of the recalls of "correct" and "wrong").

The shipped weights/shapes_proxy.safetensors (3 members of 28,045 parameters, float16: 0.17 MB) was written by

    env OMP_NUM_THREADS=1 python scripts/train_shapes_proxy.py

on this repository's 2-core machine beside two training runs: 4.8 min wall, 4.6 min of CPU. Its held-out agreement
with the judge (mean of the members' probabilities; members 0 / 1 / 2):

    renders of the 360 test prompts (1,080 scenes, 0.568 judged correct)   0.885 (0.904 / 0.877 / 0.868)
        per tag: single object 0.933, two objects 0.950, counting 0.700, colours 0.944, position 0.894,
        colour attribution 0.889
    the shapes model's samples of them (360, 0.358 judged correct)        0.836 (0.842 / 0.842 / 0.828), balanced 0.824
        per tag: 0.833, 0.883, 0.633, 0.900, 0.867, 0.900

Counting is its weakest tag: the judge counts every shape above 0.3, faint ones included, which the maps' density
(drawn at the kept objects) must learn. The weights shipped before the judge took that rule (labelled with GenEval's
0.9 counting rule) agreed on 0.907 of the renders and 0.850 of the samples.

The run is a pure function of --seed and --threads (rendering uses one NumPy generator; the model's noise is seeded by
prompt index; the training one torch generator per member).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # waiting threads sleep (scripts/pretrain_shapes.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eval as evaluation  # noqa: E402
import flags  # noqa: E402
import geneval  # noqa: E402
import models  # noqa: E402
import shapes  # noqa: E402
from shapes import proxy  # noqa: E402

PERTURBATIONS = ("class", "count", "color", "relation", "missing", "swap", "extra", "random")
HELD_OUT_NOISE_SEED = 0  # eval.py's noise for the held-out prompts, as train.py evaluates with
TRAIN_NOISE_SEED = 1  # the training samples' noise: another stream


# ----------------------------------------------------------------------------- data

def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def perturb(metadata, rng):
    """(kind, metadata of a scene that differs from `metadata` in one way), the kind drawn among those that apply."""
    include = [dict(c) for c in metadata["include"]]
    objects = sum(c["count"] for c in include)
    kinds = ["class", "count", "random"]
    kinds += ["color"] * any("color" in c for c in include) + ["relation"] * any("position" in c for c in include)
    kinds += ["missing", "swap"] * (len(include) > 1) + ["extra"] * (objects < 4)
    kind = kinds[rng.integers(len(kinds))]
    i = int(rng.integers(len(include)))
    if kind == "class":
        include[i]["class"] = _other(shapes.SHAPES, include[i]["class"], rng)
    elif kind == "count":  # one more or one fewer, the scene keeping 1-4 objects
        room = 4 - objects
        choices = [n for n in (include[i]["count"] - 1, include[i]["count"] + 1) if 1 <= n <= include[i]["count"] + room]
        include[i]["count"] = choices[rng.integers(len(choices))]
    elif kind == "color":
        i = next(j for j in rng.permutation(len(include)) if "color" in include[j])
        include[i]["color"] = _other(tuple(shapes.COLORS), include[i]["color"], rng)
    elif kind == "relation":
        i = next(j for j, c in enumerate(include) if "position" in c)
        include[i]["position"] = [_other(geneval.RELATIONS, include[i]["position"][0], rng), 0]
    elif kind == "missing":  # the other clause stays, without a relation to the one gone
        include = [{k: v for k, v in include[1 - i].items() if k != "position"}]
    elif kind == "swap":
        include[0]["class"], include[1]["class"] = include[1]["class"], include[0]["class"]
    elif kind == "extra":
        include.append({"class": shapes.SHAPES[rng.integers(3)], "count": 1,
                        "color": list(shapes.COLORS)[rng.integers(len(shapes.COLORS))]})
    else:
        tag = shapes.TAGS[rng.integers(len(shapes.TAGS))]
        rows = shapes.prompt_rows(tag)
        return kind, rows[rng.integers(len(rows))]["metadata"]
    return kind, {"tag": metadata["tag"], "include": include, "exclude": []}


def _other(names, name, rng):
    others = [n for n in names if n != name]
    return others[rng.integers(len(others))]


def rendered(rows, rng, *, per_row=None, n=None, correct_fraction=1 / 3):
    """Scenes for prompt rows -> (uint8 [N, 32, 32, 3], the rows they are judged against, their kinds): `n` scenes
    for rows drawn at random, each the row's own with probability correct_fraction; or, with per_row, one of each
    row's own and per_row - 1 perturbed ones."""
    plan = ([(row, k == 0) for row in rows for k in range(per_row)] if per_row else
            [(rows[rng.integers(len(rows))], rng.random() < correct_fraction) for _ in range(n)])
    images, judged, kinds = [], [], []
    for row, own in plan:
        while True:
            kind, drawn = ("own", row["metadata"]) if own else perturb(row["metadata"], rng)
            try:
                images.append(shapes.render(drawn, shapes.RESOLUTION, rng))
                break
            except RuntimeError:  # no layout for it (a relation among 4 objects): perturb another way
                continue
        judged.append(row)
        kinds.append(kind)
    return np.stack(images), judged, kinds


def model_samples(rows, seed, pipe, batch_size=64):
    """The shapes model's ODE samples of the rows' prompts (eval.py's sampler: 10 Euler steps, CFG 1), prompt i on
    eval.seeded_noise(seed, i) -> uint8 [N, 32, 32, 3]."""
    if not rows:
        return np.zeros((0, shapes.RESOLUTION, shapes.RESOLUTION, 3), np.uint8)
    images = evaluation.sample_images(pipe, [r["prompt"] for r in rows], resolution=shapes.RESOLUTION, num_steps=10,
                                      guidance_scale=1.0, seed=seed, batch_size=batch_size)
    return images.numpy()


def judge(images, rows):
    """The exact judge on each image -> (its official 0/1 verdict [N], the maps its detections draw: class [N, h, w]
    long (shapes.SHAPES, then background, then a blob of no class), colour [N, h, w] long (-1: background), object
    density [N, h, w] float (a normalised Gaussian bump, std 2 px, at the centre of each object the judge keeps)),
    h = 32 / 2. The verdict is the geneval reward's (`--reward geneval --geneval-detector shapes`: shapes.detect, then
    geneval.geneval_judge on the row's metadata, geneval_correct)."""
    n, side = len(images), shapes.RESOLUTION // 2
    verdicts, classes = torch.zeros(n), torch.full((n, side, side), len(shapes.SHAPES), dtype=torch.long)
    colors, density = torch.full((n, side, side), -1, dtype=torch.long), torch.zeros(n, side, side)
    centres = torch.arange(side) * 2 + 1.0  # cell centres in pixels
    for i, (image, row) in enumerate(zip(images, rows)):
        detections = shapes.detect(image)[0]
        verdicts[i] = geneval.geneval_judge(row["metadata"], detections,  # the shapes world's counting rule
                                            counting_threshold=shapes.COUNTING_THRESHOLD)["correct"]
        for d in sorted(detections, key=lambda d: d["mask"].sum()):  # larger objects first win a shared cell
            cells = torch.from_numpy(d["mask"].reshape(side, 2, side, 2).sum((1, 3)) >= 2)  # [h, w]
            known = d["class"] in shapes.SHAPES
            classes[i][cells] = shapes.SHAPES.index(d["class"]) if known else len(shapes.SHAPES) + 1
            colors[i][cells] = list(shapes.COLORS).index(d["color"])
            if known and d["score"] > geneval.THRESHOLD:  # an object the judge keeps
                x, y = (d["box"][0] + d["box"][2]) / 2, (d["box"][1] + d["box"][3]) / 2
                bump = torch.exp(-((centres[None, :] - x) ** 2 + (centres[:, None] - y) ** 2) / (2 * 2.0 ** 2))
                density[i] += bump / bump.sum()
    return verdicts, classes, colors, density


# ----------------------------------------------------------------------------- training and evaluation

def train_member(images, codes, targets, seed, args):
    """One member: the logistic loss of the verdict plus the maps' losses (cross-entropy of the class and colour
    maps, 10 x the squared error of the density summed over cells, the squared error of its sum: the count)), Adam, cosine learning rate to 0, batches drawn by a
    torch generator seeded with `seed` (which also draws the initial weights)."""
    torch.manual_seed(seed)
    net = proxy.ProxyNet(shapes.SHAPES, tuple(shapes.COLORS), resolution=shapes.RESOLUTION, width=args.width,
                         hidden=args.hidden)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(seed)
    images, (labels, classes, colors, density) = torch.from_numpy(images), targets
    window = []
    for step in range(args.steps):
        for group in opt.param_groups:  # cosine from lr to 0 (Loshchilov & Hutter 2017, without restarts)
            group["lr"] = args.lr * 0.5 * (1 + np.cos(np.pi * step / args.steps))
        ids = torch.randint(len(labels), (args.batch_size,), generator=gen)
        class_logits, color_logits, dens = net.maps(images[ids])
        verdict = F.binary_cross_entropy_with_logits(net.judge(class_logits, color_logits, dens, codes[ids]),
                                                     labels[ids])
        maps = (F.cross_entropy(class_logits, classes[ids]) + F.cross_entropy(color_logits, colors[ids], ignore_index=-1)
                + 10 * ((dens - density[ids]) ** 2).sum((1, 2)).mean()  # the bumps, and the count they sum to
                + ((dens.sum((1, 2)) - density[ids].sum((1, 2))) ** 2).mean())
        loss = verdict + args.map_weight * maps
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append((verdict.item(), maps.item()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            v, m = np.mean(window, 0)
            print(f"  member seed {seed}  step {step + 1:5d}  verdict loss {v:.4f}  maps loss {m:.4f}", flush=True)
            window = []
    return net.eval()


def agreement(p, truth, tags=None):
    """{accuracy, judge's share correct, balanced accuracy (mean of the two recalls), and accuracy per tag}."""
    said, truth = p > 0.5, truth > 0.5
    out = {"n": len(truth), "accuracy": (said == truth).float().mean().item(), "judged_correct": truth.float().mean().item()}
    recalls = [(said[truth == v] == v).float().mean().item() for v in (True, False) if (truth == v).any()]
    out["balanced"] = float(np.mean(recalls))
    for tag in shapes.TAGS if tags is not None else ():
        mine = torch.tensor([t == tag for t in tags])
        if mine.any():
            out[tag] = (said[mine] == truth[mine]).float().mean().item()
    return out


def report(name, result):
    tags = "  ".join(f"{tag} {result[tag]:.3f}" for tag in shapes.TAGS if tag in result)
    print(f"  {name:<22} n {result['n']:5d}  accuracy {result['accuracy']:.3f}  balanced {result['balanced']:.3f}  "
          f"judge correct {result['judged_correct']:.3f}" + (f"  | {tags}" if tags else ""), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=proxy.WEIGHTS, help="safetensors file written at the end (all members)")
    p.add_argument("--seed", type=flags.SEED, default=0,
                   help="seed of the rendered scenes; member k trains from seed + k (weights and batch order)")
    p.add_argument("--ensemble", type=flags.POSITIVE_INT, default=3, help="members trained (each its own seed)")
    p.add_argument("--renders", type=flags.NONNEG_INT, default=6000, help="rendered training scenes")
    p.add_argument("--samples", type=flags.NONNEG_INT, default=1500,
                   help="training samples of the shapes model (training prompts drawn at random)")
    p.add_argument("--held-out-samples", type=flags.NONNEG_INT, default=360,
                   help="held-out samples of the shapes model: the first N rows of --test-prompts (0: none)")
    p.add_argument("--train-prompts", default="prompts/shapes_train.jsonl", help="GenEval rows the training set uses")
    p.add_argument("--test-prompts", default="prompts/shapes_test.jsonl", help="held-out GenEval rows")
    p.add_argument("--steps", type=flags.POSITIVE_INT, default=2000, help="optimizer steps per member")
    p.add_argument("--batch-size", type=flags.POSITIVE_INT, default=64, help="images per step")
    p.add_argument("--lr", type=flags.bounded(float, 0, 1, low_open=True), default=2e-3,
                   help="peak Adam learning rate (cosine to 0)")
    p.add_argument("--map-weight", type=flags.NONNEG, default=1.0,
                   help="weight of the maps' losses (class, colour, density) beside the verdict's")
    p.add_argument("--width", type=flags.POSITIVE_INT, default=32, help="channels of the convolutions")
    p.add_argument("--hidden", type=flags.POSITIVE_INT, default=64, help="width of the head's MLP")
    p.add_argument("--threads", type=flags.POSITIVE_INT, default=1,
                   help="torch threads (the weights depend on it in the last bits)")
    p.add_argument("--log-every", type=flags.POSITIVE_INT, default=500, help="steps between loss lines")
    args = p.parse_args(argv)
    if problem := flags.unwritable(args.out, "shapes_proxy.safetensors"):  # refused now, not after the training
        p.error(f"--out {args.out} {problem}")
    paths = {}
    for flag in ("train_prompts", "test_prompts"):
        path = getattr(args, flag)
        paths[flag] = flags.shipped(path)
        if not os.path.isfile(paths[flag]):
            p.error(f"--{flag.replace('_', '-')} {path}: no such file (the repository ships prompts/shapes_*.jsonl)")
    train_rows, test_rows = read_rows(paths["train_prompts"]), read_rows(paths["test_prompts"])
    if args.held_out_samples > len(test_rows):
        p.error(f"--held-out-samples {args.held_out_samples}: --test-prompts has {len(test_rows)} rows")

    torch.set_num_threads(args.threads)
    start, cpu0 = time.time(), time.process_time()
    clock = lambda: f"{(time.time() - start) / 60:.1f} min wall, {(time.process_time() - cpu0) / 60:.1f} min cpu"  # noqa: E731
    rng = np.random.default_rng(args.seed)

    # training set: renders and model samples of the training prompts, each judged exactly
    images, rows, _ = rendered(train_rows, rng, n=args.renders)
    pipe = models.load_pipeline("shapes") if args.samples or args.held_out_samples else None
    sample_rows = [train_rows[i] for i in rng.integers(len(train_rows), size=args.samples)]
    images = np.concatenate([images, model_samples(sample_rows, TRAIN_NOISE_SEED, pipe)])
    rows += sample_rows
    targets = judge(images, rows)
    labels = targets[0]
    codes = proxy.encode([r["metadata"] for r in rows], shapes.SHAPES, tuple(shapes.COLORS))
    print(f"training set: {args.renders} renders ({labels[:args.renders].mean():.3f} judged correct), {args.samples} "
          f"model samples ({labels[args.renders:].mean() if args.samples else float('nan'):.3f} judged correct); "
          f"{clock()}", flush=True)

    # held out: the test prompts' renders (own + 2 perturbed each) and the model's samples on eval.py's noise
    held_images, held_rows, _ = rendered(test_rows, rng, per_row=3)
    held = {"rendered": (held_images, held_rows, judge(held_images, held_rows)[0])}
    if args.held_out_samples:
        sample_rows = test_rows[:args.held_out_samples]
        sampled = model_samples(sample_rows, HELD_OUT_NOISE_SEED, pipe)
        held["model samples"] = (sampled, sample_rows, judge(sampled, sample_rows)[0])
    print(f"held-out sets built; {clock()}", flush=True)

    nets = []
    for k in range(args.ensemble):
        nets.append(train_member(images, codes, targets, args.seed + k, args))
        print(f"member {k} trained; {clock()}", flush=True)
    proxy.save(nets, args.out)
    nets = proxy.load(args.out)  # what was written: float16 weights, as the reward will read them
    results = {}
    for set_name, (x, r, truth) in held.items():
        metadata, tags = [row["metadata"] for row in r], [row["metadata"]["tag"] for row in r]
        probs = [proxy.probability(net, x, metadata) for net in nets]
        for k, prob in enumerate(probs):
            results[f"{set_name}, member {k}"] = agreement(prob, truth, tags)
        results[f"{set_name}, mean"] = agreement(torch.stack(probs).mean(0), truth, tags)
    size = os.path.getsize(args.out) / 1e6
    note = (f"scripts/train_shapes_proxy.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip()
            + f"; {clock()}; held-out agreement: " + json.dumps({k: round(v["accuracy"], 4) for k, v in results.items()}))
    proxy.save(nets, args.out, note=note)  # again, with the measurements in its metadata (the same tensors)
    print("held-out agreement with the exact judge (P > 0.5 against its 0/1 verdict):")
    for name, result in results.items():
        report(name, result)
    print(f"wrote {args.out} ({size:.2f} MB, {args.ensemble} members); {clock()}", flush=True)
    return results


if __name__ == "__main__":
    main()
