"""eval.py's pictures: the curves of runs (--plot), the before/after grid, the bars and the summary table, and the
selection of training samples. Fake run files and images, and tiny or shipped models, keep them to seconds."""
import argparse
import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

import eval as evaluation
import geneval
import models
import train as train_module
from test_train import ROOT

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


def test_the_rise_over_the_base_has_the_paired_standard_error():
    """Two models on the same prompts and noise: the rise is the mean per-image difference and its error that of
    the differences, far below either side's when the models agree on most images (GenEval: per tag, then
    combined as the overall accuracy combines the tags)."""
    base = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    after = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # one image flipped to correct
    means = evaluation.means_of({"reward": after}, base={"reward": base})
    assert means["rise"] == pytest.approx(1 / 8)
    assert means["rise_se"] == pytest.approx(torch.tensor([0, 1.0, 0, 0, 0, 0, 0, 0]).std().item() / math.sqrt(8))
    assert means["rise_se"] < 0.5 * math.hypot(means["reward_se"], evaluation.means_of({"reward": base})["reward_se"])
    assert "rise" not in evaluation.means_of({"reward": after})  # no base, no rise
    assert evaluation.summary_line(means).endswith(f"| rise +0.1250 +- {means['rise_se']:.4f}")

    nan = math.nan
    def run(correct, counting, colors):
        return {"reward": torch.tensor(correct), "geneval_correct": torch.tensor(correct),
                "geneval_counting": torch.tensor(counting + [nan] * 3),
                "geneval_colors": torch.tensor([nan] * 3 + colors)}
    before = run([1.0, 0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
    trained = run([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    means = evaluation.means_of(trained, base=before)
    overall = evaluation.means_of(before)["geneval_overall"]
    assert means["rise"] == pytest.approx(means["geneval_overall"] - overall)  # (1/3 + 2/3) / 2
    se = [torch.tensor(d).std().item() / math.sqrt(3) for d in ([0.0, 1.0, 0.0], [0.0, 1.0, 1.0])]
    assert means["rise_se"] == pytest.approx(math.hypot(*se) / 2)


# ----------------------------------------------------------------------------- before / after
def fake_columns(n, k, size=32):
    """k columns of n images, each a flat colour that says (column, row)."""
    out = np.zeros((k, n, size, size, 3), np.uint8)
    for c in range(k):
        for r in range(n):
            out[c, r] = (40 * c + 20, (7 * r) % 256, 200)
    return out


def test_grid_pages_are_bounded_with_one_column_per_checkpoint_and_captions():
    n, k = 30, 3  # base and two checkpoints
    columns = fake_columns(n, k)
    captions = [[("correct 1.00", True) if (r + c) % 2 else ("wrong 0.25", False) for r in range(n)]
                for c in range(k)]
    args = ([c[:, None] for c in columns], ["base\naccuracy 0.333", "step 2", "step 4"],
            [f"a photo of {r} red circles" for r in range(n)], ["counting #0"] * n, captions)
    tile, gap, side, margin = 128, 4, 220, 16  # 32 px enlarged 4x
    block, row_h = side + k * (tile + gap), tile + 23 + gap  # one column per checkpoint plus the base; a row
    pages = evaluation.compare_pages(*args, key="under each sample: verdict")
    assert [p.size[0] for p in pages] == [2 * block + margin, block]  # two blocks of rows fit in 1600 px
    head = pages[1].size[1] - 6 * row_h
    assert pages[0].size[1] == head + 12 * row_h <= 2000  # 12 + 12 rows, then 6: every prompt once
    first = np.asarray(pages[0])
    for b, r in ((0, 0), (1, 12)):  # the first row of each block
        for c in range(k):
            left = b * (block + margin) + side + c * (tile + gap)
            cell = first[head:head + tile, left:left + tile]
            assert (cell == columns[c, r, 0, 0]).all()  # the sample, enlarged nearest-neighbour to fill the tile
            strip = first[head + tile:head + tile + 20, left:left + tile].reshape(-1, 3)
            tint = (222, 245, 222) if captions[c][r][1] else (250, 224, 224)
            assert (strip == tint).all(-1).mean() > 0.5  # the verdict's colour ...
            assert (strip.astype(int).sum(-1) < 400).sum() > 20  # ... under dark text
    assert (first[head:head + tile, :side].astype(int).sum(-1) < 300).sum() > 50  # the prompt beside its row
    assert (first[:head, side:block].astype(int).sum(-1) < 300).sum() > 50  # the column names above
    narrow = evaluation.compare_pages(*args, max_width=800)  # one block a page: pages of 12, 12 and 6 rows
    assert [p.size for p in narrow] == [(block, head + 12 * row_h)] * 2 + [(block, head + 6 * row_h)]


def test_video_grid_shows_first_middle_last_frames_and_gifs(tmp_path):
    video = torch.zeros(2, 5, 16, 16, 3, dtype=torch.uint8)
    for f in range(5):
        video[:, f] = 50 * f
    (tmp_path / "grid-7.png").write_bytes(b"stale")  # a page of an earlier, longer grid
    paths = evaluation.save_compare_grid(str(tmp_path), [video, video], ["base", "step 1"], ["a", "b"], ["", ""],
                                         [[("reward +0.100", None)] * 2] * 2)
    assert [os.path.basename(p) for p in paths] == ["grid.png", "grid.gif"] and not (tmp_path / "grid-7.png").exists()
    still = np.asarray(Image.open(paths[0]))
    tile, gap = 128, 4
    assert still.shape[1] == 220 + 2 * (3 * tile + 2 * gap + gap)  # three frames per cell, one block
    head = still.shape[0] - 2 * (tile + 23 + gap)
    for j, frame in enumerate((0, 2, 4)):
        assert (still[head + 5, 220 + j * (tile + gap) + 5] == 50 * frame).all()
    gif = Image.open(paths[1])
    assert gif.n_frames == 5


def test_select_rows_spreads_over_tags_and_prefers_changed_verdicts():
    tags = ["counting"] * 4 + ["colors"] * 4 + ["position"] * 2
    base = {"reward": torch.zeros(10), "geneval_correct": torch.zeros(10)}
    after = {"reward": torch.tensor([0.1, 0.0, 0.5, 1.0, 0, 0, 0, 0.9, 0, 0]),
             "geneval_correct": torch.tensor([0.0, 0, 0, 1, 0, 0, 0, 1, 0, 0])}
    rows = evaluation.select_rows([base, after], tags, 6)
    assert rows == [3, 2, 7, 4, 8, 9]  # per tag: the changed verdict, then the largest change, then file order
    assert evaluation.select_rows([base], tags, 3) == [0, 4, 8]  # the base alone: the first of each tag


def test_summary_table_has_short_aligned_headers_and_a_row_per_checkpoint():
    tables = []
    for a in (0.333, 0.408):
        table = {"reward": a + 0.15, "geneval_overall": a, "geneval_overall_se": 0.025}
        table.update({f"geneval_{t}": a for t in TAGS})
        tables.append(table)
    lines = evaluation.summary_table(["base", "step 40 (ema)"], tables)
    assert len(lines) == 3 and lines[0].split() == ["checkpoint", "accuracy", "single", "two_obj", "counting",
                                                   "colors", "position", "attr", "reward"]
    assert lines[1].split()[:4] == ["base", "0.333", "+-", "0.025"] and lines[2].startswith("step 40 (ema)")
    ends = [i + 1 for i, ch in enumerate(lines[0]) if ch != " " and (i + 1 == len(lines[0]) or lines[0][i + 1] == " ")]
    for line in lines[1:]:  # every value ends under its header
        assert all(line[e - 1] != " " and (e == len(line) or line[e] == " ") for e in ends[1:])


def test_bars_one_group_per_tag_and_a_bar_per_checkpoint(tmp_path):
    tables = [{"reward": 0.5, "geneval_overall": 0.3, "geneval_counting": 0.1, "geneval_colors": 0.5,
               "geneval_position": math.nan} for _ in range(2)]
    assert evaluation.table_keys(tables) == [("accuracy", "geneval_overall"), ("counting", "geneval_counting"),
                                             ("colors", "geneval_colors"), ("reward", "reward")]
    other = [{"jpeg": 1.0, "reward": 1.0, "reward_se": 0.1, "ocr": 0.5}]  # the reward's one component: not repeated
    assert evaluation.table_keys(other) == [("reward", "reward"), ("ocr", "ocr")]
    edits = [{"reward": 0.25, "edit_partial": 0.5, "edit_add": 0.0, "edit_remove": math.nan}]  # no remove prompts
    assert evaluation.table_keys(edits) == [("reward", "reward"), ("edit_partial", "edit_partial"),
                                            ("edit_add", "edit_add")]
    size = Image.open(evaluation.save_bars(str(tmp_path / "bars.png"), ["base", "step 2"], tables)).size
    assert 500 <= size[0] <= 1500 and size[1] <= 500


def test_short_names():
    assert evaluation.short_names(["runs/a/checkpoints/20", "runs/a/checkpoints/40/"]) == ["step 20", "step 40"]
    assert evaluation.short_names(["runs/a/checkpoints/40", "runs/b/checkpoints/40"]) == ["a step 40", "b step 40"]
    assert evaluation.short_names(["exported"]) == ["exported"]


# ----------------------------------------------------------------------------- training samples
def test_select_samples_shows_several_prompts_with_their_failures(tmp_path):
    prompts = [p for p in "abcde" for _ in range(4)]  # five groups of four, as a rollout lays them out
    scores = [1.0, 1.0, 1.0, 1.0,  0.2, 0.9, 0.5, 0.1,  0.0, 0.0, 0.0, 0.0,  0.3, 0.8, 0.8, 0.6,  1.0, 0.0, 1.0, 1.0]
    ids = evaluation.select_samples(prompts, scores, 8)
    # The mixed groups b, d, e, then the failing group c rather than the saturated a; each by its worst and best.
    assert ids == [7, 5, 8, 11, 12, 14, 17, 19]
    assert evaluation.select_samples(prompts[4:8], scores[4:8], 3) == [3, 0, 1]  # one prompt: worst, best, next
    assert evaluation.select_samples(["a"] * 3, torch.tensor([0.5, math.nan, 0.7]), 2) == [1, 2]  # no reward: worst
    images = torch.zeros(20, 8, 8, 3, dtype=torch.uint8)
    for i in range(20):
        images[i] = 10 * i
    captions = [f"{p}\nreward {s:.3f}" for p, s in zip(prompts, scores)]
    path = evaluation.save_sample_grid(str(tmp_path / "s.png"), images, captions, ids=ids)[0]
    row = np.asarray(Image.open(path))
    assert row.shape[1] == 8 * 128 and [row[5, 128 * j + 5, 0] for j in range(8)] == [10 * i for i in ids]


# ----------------------------------------------------------------------------- eval.py end to end
@pytest.fixture(scope="module")
def shapes_checkpoint(tmp_path_factory):
    """One training step of the shipped shapes model (a full fine-tune checkpoint) on the GenEval judge."""
    out = tmp_path_factory.mktemp("shapes") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        train_module.main(["--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "8",
                           "--train-batch-size", "8", "--num-steps", "4", "--eval-every", "0", "--log-images-every",
                           "0", "--lr", "1e-3", "--steps", "1", "--out", str(out)])
    finally:
        os.chdir(cwd)
    return str(out / "checkpoints" / "1")


def test_eval_writes_before_after_grid_bars_and_table(shapes_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = [json.loads(line) for line in open("prompts/shapes_test.jsonl")]
    prompts = tmp_path / "five_per_tag.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for t in TAGS for r in [r for r in rows
                                                                            if r["metadata"]["tag"] == t][:5]))
    common = ["--model", "shapes", "--resolution", "32", "--eval-steps", "4", "--reward", "geneval",
              "--geneval-detector", "shapes", "--prompts", str(prompts), "--input-key", "prompt", "--max-prompts", "30",
              "--checkpoints", shapes_checkpoint, shapes_checkpoint, "--batch-size", "30"]  # the same one twice
    out = tmp_path / "eval"
    summary = evaluation.main([*common, "--grid-rows", "12", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(printed) if line.startswith("checkpoint"))
    assert printed[header].split() == ["checkpoint", "accuracy", "single", "two_obj", "counting", "colors",
                                       "position", "attr", "reward"]
    assert [line[:12] for line in printed[header + 1:header + 4]] == ["base        ", "step 1 (ema)", "step 1 (ema)"]
    grid = np.asarray(Image.open(out / "grid.png"))
    tile, gap, side, row_h = 128, 4, 220, 128 + 23 + 4
    assert grid.shape[1] == side + 3 * (tile + gap) and grid.shape[0] <= 2000  # 12 rows: one block, one page
    head = grid.shape[0] - 12 * row_h
    same = [np.array_equal(grid[head + y * row_h:head + y * row_h + tile, side + tile + gap:side + 2 * tile + gap],
                           grid[head + y * row_h:head + y * row_h + tile, side + 2 * (tile + gap):side + 3 * tile
                                + 2 * gap]) for y in range(12)]
    assert all(same)  # one checkpoint twice: the same noise gives the same samples
    assert not (out / "grid-2.png").exists() and (out / "bars.png").is_file()
    assert summary["results"]["base"]["geneval_overall_se"] > 0
    # Every prompt on request: 30 rows, 24 on the first page (two blocks), the rest on the second.
    evaluation.main([*common, "--grid-all", "--out", str(out)])
    assert sorted(p for p in os.listdir(out) if p.startswith("grid")) == ["grid-2.png", "grid.png"]
    sizes = [Image.open(out / p).size for p in ("grid.png", "grid-2.png")]
    assert sizes == [(2 * grid.shape[1] + 16, head + 12 * row_h), (grid.shape[1], head + 6 * row_h)]


def test_eval_takes_the_models_preset_where_the_command_line_is_silent(shapes_checkpoint, tmp_path, monkeypatch):
    """`eval.py --checkpoints <a shapes run's>` scores the shapes world's held-out file with its judge at 32 px (it
    took the tiny model, and with --model shapes sampled at 64 px and failed inside diffusers); a hub model gets its
    own size and CFG; given flags win."""
    monkeypatch.chdir(ROOT)
    def filled(*argv):
        args = argparse.Namespace(**{k: None for k in ("prompts", "input_key", "reward", "resolution", "eval_steps",
                                                       "guidance_scale", "geneval_detector",
                                                       "audio_guidance_scale")})
        for key, value in zip(argv[::2], argv[1::2]):
            setattr(args, key, value)
        evaluation.fill_from_preset(args)
        return vars(args)
    assert filled("model", "shapes") == dict(
        model="shapes", prompts="prompts/shapes_test.jsonl", input_key="prompt", reward="geneval", resolution=32,
        eval_steps=10, guidance_scale=1.0, geneval_detector="shapes", audio_guidance_scale=None)
    assert filled("model", "shapes-edit")["prompts"] == "prompts/shapes_edit_test.jsonl"
    assert filled("model", "shapes-edit")["reward"] == "shapes_edit"
    hub = filled("model", "sd3", "reward", "geneval", "prompts", "prompts/geneval_test.jsonl")
    assert (hub["resolution"], hub["guidance_scale"], hub["eval_steps"]) == (512, 4.5, 40)
    assert (hub["reward"], hub["prompts"], hub["input_key"], hub["geneval_detector"]) == (
        "geneval", "prompts/geneval_test.jsonl", "input", None)  # a hub preset names training prompts: not used
    assert filled("model", "tiny")["prompts"] == "prompts/tiny.txt" and filled("model", "tiny")["resolution"] == 64
    # no --model: the checkpoint's own (its state.json), then that model's preset
    summary = evaluation.main(["--checkpoints", shapes_checkpoint, "--max-prompts", "6",
                               "--eval-steps", "2", "--grid-rows", "2", "--out", str(tmp_path / "eval")])
    assert summary["prompts"] == "prompts/shapes_test.jsonl" and summary["num_prompts"] == 6
    assert summary["eval_steps"] == 2 and "geneval_overall" in summary["results"]["base"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "state.json").write_text(json.dumps({"model": "tiny", "step": 1}))
    with pytest.raises(SystemExit, match="different models \\(shapes, tiny\\): evaluate them in separate calls"):
        evaluation.main(["--checkpoints", shapes_checkpoint, str(other), "--out", str(tmp_path / "eval")])
    assert evaluation.trained_model([str(tmp_path / "nothing")]) is None  # refused later, as an incomplete checkpoint


def test_eval_samples_a_checkpoint_as_its_run_evaluated(shapes_checkpoint, tmp_path, capsys, monkeypatch):
    """Unset sampling flags come from the checkpoint's run (its held-out ODE steps and CFG scale, here not the
    preset's), and say so; checkpoints of runs that sampled differently are refused until the flag is given."""
    monkeypatch.chdir(ROOT)
    run = tmp_path / "guided"
    train_module.main(["--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "8", "--train-batch-size",
                       "8", "--num-steps", "4", "--eval-every", "0", "--log-images-every", "0", "--steps", "1",
                       "--eval-steps", "3", "--eval-guidance-scale", "2", "--out", str(run)])
    guided = str(run / "checkpoints" / "1")
    capsys.readouterr()
    summary = evaluation.main(["--checkpoints", guided, "--max-prompts", "2", "--grid-rows", "2",
                               "--out", str(tmp_path / "eval")])
    assert (summary["eval_steps"], summary["sampling"]["guidance_scale"]) == (3, 2.0)  # the preset: 10 and 1
    assert f"sampling as {guided}'s run evaluated: resolution 32, eval_steps 3, guidance_scale 2.0" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit, match="runs sampled at different eval_steps \\(10, 3\\): pass --eval-steps"):
        evaluation.main(["--checkpoints", shapes_checkpoint, guided, "--out", str(tmp_path / "both")])
    summary = evaluation.main(["--checkpoints", shapes_checkpoint, guided, "--eval-steps", "2", "--guidance-scale",
                               "1", "--max-prompts", "2", "--grid-rows", "2", "--out", str(tmp_path / "both")])
    assert (summary["eval_steps"], summary["sampling"]["guidance_scale"]) == (2, 1.0)


def test_eval_of_a_video_model_writes_frames_and_gifs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "wan"
    evaluation.main(["--model", "tiny-wan", "--num-frames", "5", "--resolution", "32", "--eval-steps", "2",
                     "--max-prompts", "2", "--out", str(out)])
    still = Image.open(out / "grid.png")
    assert still.size[0] == 220 + 3 * 128 + 2 * 4 + 4 and Image.open(out / "grid.gif").n_frames == 5


def test_eval_guides_a_second_expert_and_a_soundtrack_as_train_py(tmp_path, monkeypatch, capsys):
    """--guidance-scale-2 and --audio-guidance-scale reach the pipeline as train.py sets them (the families' velocity
    reads them there: tests/test_families.py, tests/test_ltx2.py); a model without the expert or the sound refuses
    each in one line."""
    monkeypatch.chdir(ROOT)
    for flag, needle in (("--guidance-scale-2", "has none"), ("--audio-guidance-scale", "makes none")):
        with pytest.raises(SystemExit) as stop:
            evaluation.main(["--model", "tiny-wan", flag, "3", "--out", str(tmp_path / "no")])
        assert stop.value.code == 2 and needle in capsys.readouterr().err
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    evaluation.main(["--model", "tiny-wan2.2", "--num-frames", "5", "--resolution", "32", "--eval-steps", "2",
                     "--guidance-scale", "3", "--guidance-scale-2", "1.5", "--max-prompts", "1",
                     "--out", str(tmp_path / "wan22")])
    assert [(p.guidance_scale_2, p.guidance_scale_audio) for p in loaded] == [(1.5, None)]


def test_diversity_groups_prefer_free_colours_spread_over_tags():
    prompts = ["a red circle", "a circle", "a red circle", "a circle", "two squares", "a circle", "two squares", "x"]
    free, fixed = {"tag": "single_object", "include": [{"class": "circle"}]}, {"tag": "colors", "include": [
        {"class": "circle", "color": "red"}]}
    metadata = [fixed, free, fixed, free, {"tag": "counting", "include": [{"class": "square", "count": 2}]}, free,
                {"tag": "counting", "include": [{"class": "square", "count": 2}]}, free]
    assert evaluation.diversity_groups(prompts, metadata) == [[1, 3], [4, 6]]  # "a circle" and "two squares", k = 2
    assert evaluation.diversity_groups(prompts, metadata, rows=1, per=8) == [[1, 3, 5]]
    only_fixed = [fixed] * 8
    assert evaluation.diversity_groups(prompts, only_fixed, rows=1) == [[0, 2]]  # no free colour: any repeat
    assert evaluation.diversity_groups(["a", "b"], [{}, {}]) == []


def test_eval_writes_a_diversity_panel_of_repeated_prompts(shapes_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = [json.loads(line) for line in open("prompts/shapes_test.jsonl")]
    chosen = [next(r for r in rows if r["prompt"] == p) for p in ("a photo of a circle", "a photo of a green square")]
    prompts = tmp_path / "repeats.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for _ in range(5) for r in chosen))  # each prompt 5 times
    shown = {}
    real = evaluation.compare_pages

    def keep(columns, names, prompts, notes, captions, **kw):
        shown.setdefault("calls", []).append(dict(columns=columns, names=names, prompts=prompts, captions=captions))
        return real(columns, names, prompts, notes, captions, **kw)
    monkeypatch.setattr(evaluation, "compare_pages", keep)
    out = tmp_path / "eval"
    summary = evaluation.main(["--model", "shapes", "--resolution", "32", "--eval-steps", "4", "--reward", "geneval",
                               "--geneval-detector", "shapes", "--prompts", str(prompts), "--input-key", "prompt",
                               "--max-prompts", "10", "--checkpoints", shapes_checkpoint, "--out", str(out)])
    panel = shown["calls"][-1]
    assert panel["prompts"] == ["a photo of a circle"]  # the green square names its colour: not a free-colour row
    assert [c.shape for c in panel["columns"]] == [(1, 5, 32, 32, 3)] * 2  # base and checkpoint, 5 images each
    assert len({panel["columns"][0][0, j].tobytes() for j in range(5)}) > 1  # each image on its own noise
    assert panel["names"][0] == f"base\ncolour diversity {summary['results']['base']['diversity_color']:.3f}"
    assert all(text.endswith("of 5 right") for column in panel["captions"] for text, _ in column)
    assert Image.open(out / "diversity.png").size[0] == 220 + 2 * (5 * 128 + 4 * 4 + 4)
