"""eval.py's pictures: the curves of runs (--plot). Fake run files keep them to seconds."""
import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

import eval as evaluation
import geneval

TAGS = geneval.TAGS


# ----------------------------------------------------------------------------- curves (--plot)
def fake_run(folder, loss, seed, *, accuracy, grad_norms, garbage=()):
    """A run folder as train.py leaves it (args.json, eval.jsonl every 2 steps, metrics.jsonl), with damaged lines."""
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"args": {"loss": loss, "seed": seed}}, f)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accuracy):
            row = {"step": 2 * i, "reward": a + 0.1, "reward_se": 0.01, "geneval_overall": a,
                   "geneval_overall_se": 0.02, "geneval_mean_over_images": a}
            row.update({f"geneval_{t}": a for t in TAGS})
            row.update({f"geneval_{t}_se": 0.05 for t in TAGS})
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, g in enumerate(grad_norms, start=1):
            f.write(json.dumps({"step": step, "reward_mean": 0.3 + 0.01 * step, "reward/geneval_correct_mean": 0.2,
                                "grad_norm": g, "loss": (-1) ** step * 1e-8, "ratio_mean": 1.0 + 1e-9 * step,
                                "clipfrac": 0.0, "approx_kl": 0.0, "zero_adv_fraction": 0.25 * (step % 2),
                                "seconds": 1.0}) + "\n")
        f.write(json.dumps({"step": len(grad_norms) + 1, "skipped": 1, "skip_reason": "reward service down",
                            "reward_mean": 9.0}) + "\n")  # a skipped step: a string that belongs, not plotted
        for line in garbage:
            f.write(line + "\n")


def test_plot_shows_held_out_first_labels_runs_and_skips_garbage_and_constants(tmp_path, capsys):
    a, b = str(tmp_path / "grpo"), str(tmp_path / "nft")
    garbage = ['{"step": 3, "grad_norm": "abc"}', '{"step": "4", "grad_norm": 1.0}', '[1, 2]', '{"step": 2, "gr']
    fake_run(a, "grpo", 0, accuracy=[0.3, 0.4, 0.45], grad_norms=[0.5, 0.7, 0.6, 0.9], garbage=garbage)
    fake_run(b, "nft", 1, accuracy=[0.3, 0.35], grad_norms=[0.2, 0.25])
    runs = [evaluation.read_run(d, [a, b]) for d in (a, b)]
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0] and "skipped 4 line" in warnings[0]
    panels = evaluation.curve_panels(runs)
    titles = [title for title, _, _ in panels]
    assert titles[0] == "held-out accuracy (GenEval overall)"
    assert titles[1:7] == [f"held-out accuracy: {t}" for t in TAGS] and titles[7] == "held-out reward"
    assert titles[8:] == ["training reward", "training accuracy (GenEval)", "gradient norm",
                          "share of zero-advantage samples"]  # loss ~1e-8, ratio 1, clipfrac 0, approx_kl 0: no panel
    labels = ["grpo (grpo, seed 0)", "nft (nft, seed 1)"]
    for title, kind, curves in panels:
        assert list(curves) == labels, title
    held = dict((t, c) for t, _, c in panels)["held-out accuracy (GenEval overall)"]
    assert held[labels[0]] == ([0, 2, 4], [0.3, 0.4, 0.45], [0.02, 0.02, 0.02])  # each point with its error
    grad = dict((t, c) for t, _, c in panels)["gradient norm"]
    assert grad[labels[0]][:2] == ([1, 2, 3, 4], [0.5, 0.7, 0.6, 0.9])  # the garbage rows left no point behind
    assert dict((t, c) for t, _, c in panels)["training reward"][labels[0]][0] == [1, 2, 3, 4]  # the skipped step
    out = evaluation.plot_runs([a, b], out=str(tmp_path / "both" / "curves.png"))
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape[1] <= 1800 and image.shape[0] <= 1400  # 12 panels in 3 rows of 4
    for colour in ((0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e)):  # matplotlib's C0 and C1: both runs are drawn
        assert (np.abs(image.astype(int) - colour).sum(-1) < 10).sum() > 100


def test_plot_without_eval_or_args_and_refusals(tmp_path, capsys):
    run = tmp_path / "tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s, "loss": 0.5 / s}) + "\n"
                                               for s in range(1, 5)))
    titles = [t for t, _, _ in evaluation.curve_panels([evaluation.read_run(str(run), [str(run)])])]
    assert titles == ["training reward", "loss"]  # a loss that moves is shown; no eval.jsonl, no held-out panels
    evaluation.main(["--plot", str(run)])
    assert (run / "curves.png").is_file() and capsys.readouterr().out.strip() == f"wrote {run / 'curves.png'}"
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, needle in ((tmp_path / "missing", "is not a folder"), (empty, "no completed step")):
        with pytest.raises(SystemExit) as e:
            evaluation.main(["--plot", str(folder)])
        assert str(e.value).startswith("error:") and needle in str(e.value) and len(str(e.value).splitlines()) == 1


def test_constancy_and_running_mean():
    assert evaluation.is_constant([1e-8, -3e-9, 2e-8]) and evaluation.is_constant([1.0, 1.0 + 1e-8, 1.0])
    assert evaluation.is_constant([0.0, 0.0, float("nan")]) and evaluation.is_constant([])
    assert not evaluation.is_constant([1e-3, 2e-3]) and not evaluation.is_constant([100.0, 100.01])
    assert evaluation.running_mean([1.0, float("nan"), 3.0, 5.0, 7.0], 3) == [1.0, 1.0, 2.0, 4.0, 5.0]


def test_standard_errors_are_written_beside_the_means():
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    result = {"reward": torch.tensor([0.9, 0.1, 0.8, 0.7, 0.2, 0.3]), "geneval_correct": correct,
              "geneval_counting": torch.tensor([1.0, 0.0, 1.0, math.nan, math.nan, math.nan]),
              "geneval_colors": torch.tensor([math.nan, math.nan, math.nan, 1.0, 0.0, 0.0])}
    means = evaluation.means_of(result)
    se_counting = torch.tensor([1.0, 0.0, 1.0]).std().item() / math.sqrt(3)
    assert means["geneval_counting_se"] == pytest.approx(se_counting)
    assert means["geneval_overall"] == pytest.approx(0.5)  # (2/3 + 1/3) / 2
    assert means["geneval_overall_se"] == pytest.approx(math.sqrt(2 * se_counting ** 2) / 2)  # both tags: same spread
    assert means["reward_se"] == pytest.approx(result["reward"].std().item() / math.sqrt(6))
    assert evaluation.summary_line({"reward": 0.5, "reward_se": 0.1}) == "reward +0.5000"
