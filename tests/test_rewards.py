"""rewards.py: formulas against hand computations on tiny random models, real OCR, real local
HTTP servers for the services, mixtures, rm_type dispatch and the NaN guard. No downloads."""

import base64
import io
import json
import logging
import math
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import data
import reward_fixtures
import rewards
import reward_services
from reward_server import JsonServer, chat_reply
from rewards import NonFiniteReward, RewardServiceError, build_reward, ocr_score

FAST = dict(reward_backoff=0.001)  # retries without waiting
KEY = "sk-test-7f3a9c1e5b2d"


def make(name, **options):
    """One factory of REWARDS with the flags' defaults for the options not given."""
    return rewards.REWARDS[name](device="cpu", **{**rewards.option_defaults(), **options})


def random_images(n, size=32, seed=0, frames=None):
    shape = (n, size, size, 3) if frames is None else (n, frames, size, size, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def text_image(text, size=(320, 96)):
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((10, 20), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(img)


# ----------------------------------------------------------------------------- images

def test_to_uint8_rounds_half_to_even_and_clamps():
    x = torch.tensor([-0.2, 0.0, 0.5 / 255, 1.5 / 255, 0.3, 1.0, 1.7]).view(1, 1, 7, 1).expand(1, 1, 7, 3)
    got = rewards.to_uint8(x)[0, 0, :, 0].tolist()
    assert got == [0, 0, 0, 2, round(0.3 * 255), 255, 255]  # 0.5 -> 0 and 1.5 -> 2: half to even
    u = random_images(2)
    assert rewards.to_uint8(torch.from_numpy(u)).tobytes() == u.tobytes()
    with pytest.raises(ValueError, match="channels last"):
        rewards.to_uint8(torch.zeros(2, 3, 8, 8))


# ----------------------------------------------------------------------------- OCR

@pytest.mark.parametrize("recognized, prompt, expected", [
    ("HELLO world", 'a sign saying "hello world"', 1.0),           # case and spaces ignored
    ("xx hello world yy", 'a sign "Hello World" on a wall', 1.0),   # substring hit
    ("hellp world", 'a sign "hello world"', 1 - 1 / 10),            # one edit over 10 characters
    ("", 'a sign "abc"', 0.0),                                      # nothing read: distance capped at len
    ("a completely different long text", 'a "cat"', 0.0),           # distance > len(target) is capped
    ("abc", "no quotes here", 0.0),                                 # no target
    ("abc", 'only one " quote', 0.0),                               # no pair of quotes
    ("abc", 'empty "" target', 0.0),
    ("abc", 'first "abc" then "xyz"', 1.0),                         # first pair wins
])
def test_ocr_score(recognized, prompt, expected):
    assert ocr_score(recognized, prompt) == pytest.approx(expected)


def test_rapidocr_reads_rendered_text():
    reward = build_reward("ocr", ocr_workers=2)
    images = np.stack([text_image("Hello World"), np.full((96, 320, 3), 255, np.uint8), text_image("Hello World")])
    prompts = ['a sign that says "hello world"', 'a sign that says "hello world"', 'a sign that says "goodbye"']
    out = reward(images, prompts, None)
    assert out["ocr"][0] >= 0.8
    assert out["ocr"][1] == 0.0  # blank image: nothing read
    expected = ocr_score("helloworld", prompts[2])  # what the third should score given a perfect read
    assert out["ocr"][2] == pytest.approx(expected, abs=0.15) and out["ocr"][2] < 0.5
    assert torch.equal(out["reward"], out["ocr"])


def test_paddle_backend_missing_is_one_clear_error():
    try:
        import paddleocr  # noqa: F401
        pytest.skip("paddleocr is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="pip install .*paddleocr"):
        make("ocr", ocr_backend="paddle")
    with pytest.raises(ValueError, match="rapidocr"):
        make("ocr", ocr_backend="tesseract")


# ----------------------------------------------------------------------------- JPEG

def test_jpeg_rewards_match_pil_sizes():
    images = random_images(2, size=48)
    images[1] = 128  # flat: compresses well
    sizes = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(len(buf.getvalue()) / 1000)
    out = build_reward("jpeg_compressibility=1,jpeg_incompressibility=0.5")(images, ["", ""], [{}, {}])
    assert out["jpeg_compressibility"].tolist() == pytest.approx([-s / 500 for s in sizes])
    assert out["jpeg_incompressibility"].tolist() == pytest.approx([s / 500 for s in sizes])
    assert out["reward"].tolist() == pytest.approx([-0.5 * s / 500 for s in sizes])
    assert out["jpeg_compressibility"][1] > out["jpeg_compressibility"][0]
    video = np.stack([images, images[::-1]], axis=1)  # [2, 2, H, W, 3]: each clip has one noisy, one flat frame
    assert make("jpeg_incompressibility")(video, None, None).tolist() == pytest.approx([np.mean(sizes) / 500] * 2)


# ----------------------------------------------------------------------------- PickScore

@pytest.fixture(scope="module")
def tiny_pickscore(tmp_path_factory):
    return reward_fixtures.tiny_pickscore(str(tmp_path_factory.mktemp("pickscore")))


def test_pickscore_formula_batching_and_frames(tiny_pickscore):
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(tiny_pickscore).eval()
    processor = AutoProcessor.from_pretrained(tiny_pickscore)
    images, prompts = random_images(3, size=40), ["a red cat", "a blue dog on a mat", "text"]

    with torch.no_grad():  # by hand: tower -> projection -> normalise -> exp(logit_scale) cos / 26
        pix = processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]
        v = model.visual_projection(model.vision_model(pixel_values=pix).pooler_output)
        expected = []
        for k, p in enumerate(prompts):
            tok = processor(text=[p], return_tensors="pt")
            t = model.text_projection(model.text_model(input_ids=tok["input_ids"]).pooler_output)[0]
            cos = (t @ v[k]) / (t.norm() * v[k].norm())
            expected.append(math.exp(model.logit_scale.item()) * cos.item() / 26)

    paths = dict(pickscore_processor_path=tiny_pickscore, pickscore_model_path=tiny_pickscore)
    batched, single = make("pickscore", **paths, pickscore_batch_size=8), make("pickscore", **paths, pickscore_batch_size=1)
    got = batched(images, prompts, [{}] * 3)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert single(images, prompts, [{}] * 3).tolist() == pytest.approx(got.tolist(), abs=1e-5)
    assert float(got.std()) > 1e-4  # the scores differ: the test can tell images apart

    video = random_images(2, size=40, frames=5, seed=1)  # [2, 5, H, W, 3]
    per_frame = batched(video.reshape(10, 40, 40, 3), [p for p in prompts[:2] for _ in range(5)], None).view(2, 5)
    three = make("pickscore", **paths, pickscore_num_frames=3)
    assert three(video, prompts[:2], None).tolist() == pytest.approx(per_frame[:, [0, 2, 4]].mean(1).tolist(), abs=1e-5)
    assert batched(video, prompts[:2], None).tolist() == pytest.approx(per_frame.mean(1).tolist(), abs=1e-5)


def test_pickscore_missing_model_names_the_flag(tiny_pickscore, tmp_path):
    with pytest.raises(RuntimeError, match="--pickscore-model-path"):
        make("pickscore", pickscore_processor_path=tiny_pickscore, pickscore_model_path=str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="--pickscore-processor-path"):
        make("pickscore", pickscore_processor_path=str(tmp_path / "nowhere"), pickscore_model_path=tiny_pickscore)


# ----------------------------------------------------------------------------- HPS

@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    return reward_fixtures.tiny_hps(str(tmp_path_factory.mktemp("hps")))


def test_hps_formula_and_batching(tiny_hps):
    import open_clip

    name, path = tiny_hps
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None)
    model.load_state_dict(torch.load(path)["state_dict"])
    model.eval()
    images, prompts = random_images(3, size=48, seed=2), ["a red cat", "a dog", "a very long prompt " * 20]
    with torch.no_grad():  # by hand: diag(I @ T^T) of normalised features, one forward for the whole batch
        i = model.encode_image(torch.stack([preprocess(Image.fromarray(x)) for x in images]))
        t = model.encode_text(open_clip.get_tokenizer(name)(prompts))
        logits = (i / i.norm(dim=-1, keepdim=True)) @ (t / t.norm(dim=-1, keepdim=True)).T
    expected = torch.diagonal(logits)

    got = make("hps", hps_checkpoint_path=path, hps_model_name=name, hps_batch_size=8)(images, prompts, None)
    one = make("hps", hps_checkpoint_path=path, hps_model_name=name, hps_batch_size=1)(images, prompts, None)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert one.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert float(got.std()) > 1e-4


def test_hps_errors(tiny_hps, tmp_path):
    name, path = tiny_hps
    with pytest.raises(RuntimeError, match="--hps-checkpoint-path"):
        make("hps", hps_checkpoint_path=str(tmp_path / "missing.pt"), hps_model_name=name)
    with pytest.raises(ValueError, match="v2.1"):
        make("hps", hps_version="v3", hps_checkpoint_path=path, hps_model_name=name)
    with pytest.raises(ValueError, match="--hps-batch-size must be an integer >= 1, got int 0"):
        make("hps", hps_checkpoint_path=path, hps_model_name=name, hps_batch_size=0)
    if os.environ.get("HF_HUB_OFFLINE") == "1":  # the default hub file cannot be fetched: the error names the flag
        with pytest.raises(RuntimeError, match="HPS_v2.1_compressed.pt.*--hps-checkpoint-path"):
            make("hps", hps_model_name=name)


# ----------------------------------------------------------------------------- OpenAI-compatible API

def judge_server(score_of=lambda prompt: len(prompt) % 5, *, delay=0.0, content=None, status=200):
    """A Chat Completions server: the score is a function of the generation prompt."""
    def respond(body, headers):
        prompt = body["messages"][1]["content"][0]["text"].removeprefix("Prompt: ")
        reply = content(prompt) if content else json.dumps({"score": score_of(prompt)})
        return status, chat_reply(reply) if status == 200 else f'{{"error": "Incorrect API key provided: {KEY}"}}', delay
    return JsonServer(respond)


def api_config(tmp_path, url, **extra):
    (tmp_path / "rubric.txt").write_text("Grade it 0-4. Reply {\"score\": n}.")
    config = {"model": "judge-1", "api_key_env": "REWARD_TEST_KEY", "base_url": url + "/v1", "prompt_path": "rubric.txt", **extra}
    (tmp_path / "judge.yaml").write_text(json.dumps(config))  # JSON is YAML
    return str(tmp_path / "judge.yaml")


PROMPTS = ["a cat", "two dogs", "a red car", "tree", "a house by the lake", "x"]


def test_openai_api_request_shape_and_scores(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    images = random_images(len(PROMPTS))
    with judge_server() as server:
        reward = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), **FAST)
        out = reward(images, PROMPTS, None)
    assert out["openai_api"].tolist() == [len(p) % 5 for p in PROMPTS]
    assert not out["failed"].any()
    body = next(b for b in server.bodies if b["messages"][1]["content"][0]["text"] == "Prompt: two dogs")
    assert body["model"] == "judge-1"
    assert body["messages"][0] == {"role": "system", "content": "Grade it 0-4. Reply {\"score\": n}."}
    url = body["messages"][1]["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert np.array_equal(np.asarray(png), images[1])  # lossless: the judge sees our pixels
    assert all(h["Authorization"] == f"Bearer {KEY}" for h in server.headers)


@pytest.mark.parametrize("content, match", [
    (lambda p: json.dumps({"score": 7}), r"score 7.0 outside \[0.0, 4.0\]"),
    (lambda p: "I would give it a three", "not JSON"),
    (lambda p: json.dumps({"rating": 3}), "not JSON"),
    (lambda p: json.dumps({"score": "3"}), "not a number"),
])
def test_openai_api_bad_replies_name_the_sample(tmp_path, monkeypatch, content, match):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    bad = lambda p: content(p) if p == "tree" else json.dumps({"score": 2})  # noqa: E731
    with judge_server(content=bad) as server:
        reward = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), reward_retries=2, **FAST)
        with pytest.raises(RewardServiceError, match=f"openai_api: sample 3 failed after 2 attempt.*{match}"):
            reward(random_images(len(PROMPTS)), PROMPTS, None)


def test_openai_api_fenced_json_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    with judge_server(content=lambda p: '```json\n{"score": 3.5, "reason": "fine"}\n```') as server:
        out = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url))(random_images(2), PROMPTS[:2], None)
    assert out["reward"].tolist() == [3.5, 3.5]


def test_openai_api_timeout_concurrency_and_inline_config(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    with judge_server(delay=1.0) as server:
        inline = "base64:" + base64.b64encode(json.dumps(
            {"model": "m", "api_key_env": "REWARD_TEST_KEY", "base_url": server.url, "timeout_s": 0.2}).encode()).decode()
        reward = build_reward("openai_api", openai_api_rm_config=inline, reward_retries=2, **FAST)
        with pytest.raises(RewardServiceError, match="openai_api: sample 0 .*TimeoutError: no complete reply within the 0.2 s"):
            reward(random_images(1), ["slow"], None)
    with judge_server(delay=0.2) as server:
        config = api_config(tmp_path, server.url, max_concurrency=3)
        out = build_reward("openai_api", openai_api_rm_config=config)(random_images(12), [f"p{i}" for i in range(12)], None)
    assert server.max_in_flight == 3  # bounded, and actually concurrent
    assert out["reward"].tolist() == [len(f"p{i}") % 5 for i in range(12)]
    with pytest.raises(ValueError, match="prompt_path is not allowed in an inline config"):
        payload = base64.b64encode(json.dumps({"model": "m", "prompt_path": "r.txt"}).encode()).decode()
        build_reward("openai_api", openai_api_rm_config="base64:" + payload)


def test_api_key_never_in_logs_or_errors(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    with judge_server(status=401) as server:  # the server echoes the key in its error body, as some do
        reward = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), **FAST)
        with pytest.raises(RewardServiceError) as err:
            reward(random_images(2), PROMPTS[:2], None)
    assert "HTTP 401" in str(err.value) and "***" in str(err.value)
    assert "after 1 attempt(s)" in str(err.value)  # the attempts made, not --reward-retries
    assert len(server.bodies) <= 2  # a 401 is not retried (the other sample may not be sent: raise mode stops)
    with judge_server(status=503) as server:  # retried, logged at each attempt
        reward = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), reward_on_error="skip", **FAST)
        out = reward(random_images(2), PROMPTS[:2], None)
    assert out["failed"].tolist() == [True, True] and len(server.bodies) == 6
    assert "retrying" in caplog.text
    scorer_text = repr(rewards.OpenAIJudge(model="m", api_key_env="REWARD_TEST_KEY"))
    for text in (str(err.value), repr(err.value), caplog.text, scorer_text):
        assert KEY not in text

    monkeypatch.delenv("REWARD_TEST_KEY")
    with pytest.raises(ValueError, match="REWARD_TEST_KEY") as err:
        build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, "http://127.0.0.1:9"))
    assert "\n" not in str(err.value)


def test_flaky_service_retries_and_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    prompts = [f"prompt {i}" for i in range(20)]
    seen = {}

    def respond(body, headers):  # samples i % 3 == 0 fail their first attempt (~30 %), i % 7 == 4 always fail
        prompt = body["messages"][1]["content"][0]["text"].removeprefix("Prompt: ")
        i = int(prompt.split()[1])
        seen[i] = seen.get(i, 0) + 1
        if (i % 3 == 0 and seen[i] == 1) or (permanent and i % 7 == 4):
            return 500, "{}", 0.0
        return 200, chat_reply(json.dumps({"score": i % 5})), 0.0

    permanent = False
    with JsonServer(respond) as server:
        out = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), **FAST)(
            random_images(20), prompts, None)
    assert out["reward"].tolist() == [i % 5 for i in range(20)]
    assert sum(seen.values()) == 20 + 7  # seven samples (0, 3, ..., 18) needed a second attempt

    permanent, seen = True, {}
    with JsonServer(respond) as server:
        out = build_reward("openai_api=2", openai_api_rm_config=api_config(tmp_path, server.url),
                           reward_on_error="skip", **FAST)(random_images(20), prompts, None)
    dead = [i % 7 == 4 for i in range(20)]
    assert out["failed"].tolist() == dead
    assert out["reward"].tolist() == [0.0 if d else 2.0 * (i % 5) for i, d in enumerate(dead)]
    assert all(math.isnan(v) == d for v, d in zip(out["openai_api"].tolist(), dead))
    assert all(seen[i] == 3 for i in range(20) if dead[i])  # reward_retries attempts, then skipped


def test_custom_api_hooks(tmp_path, monkeypatch):
    from reward_server import JsonServer as Server

    requests = []

    def respond(body, headers):
        requests.append(body)
        return 200, {"value": len(body["text"])}, 0.0

    with Server(respond) as server:
        config = tmp_path / "api.yaml"
        config.write_text(f"class: reward_server.PlainScoreApi\nurl: {server.url}\nscale: 0.5\nmax_concurrency: 2\n")
        out = build_reward("custom_api", custom_api_rm_config=str(config))(
            random_images(3), ["a", "bbb", "cc"], [{"tag": 1}, {}, {"tag": 3}])
    assert out["custom_api"].tolist() == [0.5, 1.5, 1.0]
    assert sorted(r["tag"] or 0 for r in requests) == [0, 1, 3]
    assert server.max_in_flight <= 2

    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    with judge_server(score_of=lambda p: 4 if p.isupper() else 0) as server:  # a subclass of the built-in judge
        config = tmp_path / "shout.yaml"
        config.write_text(f"class: reward_server.ShoutingJudge\nmodel: m\napi_key_env: REWARD_TEST_KEY\nbase_url: {server.url}\n")
        out = build_reward("custom_api", custom_api_rm_config=str(config))(random_images(2), ["a cat", "a dog"], None)
    assert out["reward"].tolist() == [4.0, 4.0]


# ----------------------------------------------------------------------------- remote

def test_remote_protocol(tmp_path):
    def respond(body, headers):
        if body["prompts"][0] == "slow":
            return 200, {"scores": [1.0]}, 1.0
        if body["prompts"][0] == "short":
            return 200, {"scores": [1.0]}, 0.0
        if body["prompts"][0] == "html":
            return 200, "<html>oops</html>", 0.0
        images = [[Image.open(io.BytesIO(base64.b64decode(f))) for f in (s if isinstance(s, list) else [s])] for s in body["images"]]
        scores = [float(np.mean([np.asarray(f).mean() for f in frames])) + m.get("bonus", 0) for frames, m in zip(images, body["metadata"])]
        return 200, {"scores": scores}, 0.05

    images = random_images(6, seed=3)
    metadata = [{"bonus": i} for i in range(6)]
    expected = [float(images[i].mean()) + i for i in range(6)]
    with JsonServer(respond) as server:
        out = build_reward("remote", rm_url=server.url)(images, [f"p{i}" for i in range(6)], metadata)
        assert out["remote"].tolist() == pytest.approx(expected, rel=1e-6)
        assert len(server.bodies) == 1 and server.bodies[0]["prompts"] == [f"p{i}" for i in range(6)]

        chunked = build_reward("remote", rm_url=server.url, remote_batch_size=1, remote_max_concurrency=2)
        assert chunked(images, [f"p{i}" for i in range(6)], metadata)["reward"].tolist() == pytest.approx(expected, rel=1e-6)
        assert server.max_in_flight == 2

        video = random_images(2, frames=3, seed=4)
        got = build_reward("remote", rm_url=server.url)(video, ["v0", "v1"], None)["reward"]
        assert got.tolist() == pytest.approx([float(video[i].mean()) for i in range(2)], rel=1e-6)

        for prompt, match in [("short", "1 scores for 2 samples"), ("html", "not JSON"), ("slow", "0.2 s deadline")]:
            reward = build_reward("remote", rm_url=server.url, reward_timeout=0.2, reward_retries=2, **FAST)
            with pytest.raises(RewardServiceError, match=f"remote: sample 0-1 .*{match}"):
                reward(images[:2], [prompt, "x"], None)
        skip = build_reward("remote", rm_url=server.url, reward_on_error="skip", remote_batch_size=2, **FAST)
        out = skip(images[:4], ["p0", "p1", "short", "x"], None)
        assert out["failed"].tolist() == [False, False, True, True]
        assert out["reward"][2:].tolist() == [0.0, 0.0] and out["reward"][0] == pytest.approx(float(images[0].mean()))
    with pytest.raises(ValueError, match="--rm-url"):
        build_reward("remote")


# ----------------------------------------------------------------------------- edits: rewards that see the source

def edit_rows(tmp_path, n=3, seed=7):
    """n prompt rows with source images on disk, loaded as train.py loads them -> (prompts, metadata, sources)."""
    sources = random_images(n, size=16, seed=seed)
    lines = []
    for i, source in enumerate(sources):
        Image.fromarray(source).save(tmp_path / f"src{i}.png")
        lines.append(json.dumps({"input": f"edit {i}", "image": f"src{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines))
    prompts, metadata = data.load_prompts(tmp_path / "edits.jsonl")
    return prompts, metadata, sources


def decode_png(text):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(text.split(",", 1)[-1]))))


def test_openai_api_shows_the_judge_the_source_first(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)
    prompts, metadata, sources = edit_rows(tmp_path)
    images = random_images(3, seed=8)
    config = {"model": "judge-1", "api_key_env": "REWARD_TEST_KEY"}
    with judge_server() as server:
        config["base_url"] = server.url + "/v1"
        reward = build_reward("openai_api", openai_api_rm_config=config, **FAST)
        out = reward(images, prompts, metadata)
        plain = reward(images[:1], ["a cat"], [{}])
    assert out["openai_api"].tolist() == [len(p) % 5 for p in prompts] and plain["reward"].tolist() == [0.0]
    edit = next(b for b in server.bodies if b["messages"][1]["content"][0]["text"] == "Prompt: edit 1")
    content = edit["messages"][1]["content"]
    assert [c["type"] for c in content] == ["text", "text", "image_url", "text", "image_url"]
    assert content[1]["text"] == "Source image 1:" and content[3]["text"] == "Edited image:"
    assert np.array_equal(decode_png(content[2]["image_url"]["url"]), sources[1])
    assert np.array_equal(decode_png(content[4]["image_url"]["url"]), images[1])
    assert edit["messages"][0]["content"] == reward_services.EDIT_RUBRIC
    text_only = next(b for b in server.bodies if b["messages"][1]["content"][0]["text"] == "Prompt: a cat")
    assert text_only["messages"][0]["content"] == reward_services.DEFAULT_RUBRIC
    assert len(text_only["messages"][1]["content"]) == 2
    with judge_server() as server:  # a rubric of the config serves edits too
        reward = build_reward("openai_api", openai_api_rm_config=api_config(tmp_path, server.url), **FAST)
        reward(images[:1], prompts[:1], metadata[:1])
    assert server.bodies[0]["messages"][0]["content"] == "Grade it 0-4. Reply {\"score\": n}."


def test_remote_sends_each_sample_its_source_images(tmp_path):
    prompts, metadata, sources = edit_rows(tmp_path)

    def respond(body, headers):  # score: how far each image is from its first source
        got = [[decode_png(s) for s in per_sample] for per_sample in body["source_images"]]
        images = [decode_png(i) for i in body["images"]]
        return 200, {"scores": [float(np.abs(i.astype(int) - g[0]).mean()) if g else -1.0
                                for i, g in zip(images, got)]}, 0.0

    images = random_images(4, size=16, seed=9)
    with JsonServer(respond) as server:
        out = build_reward("remote", rm_url=server.url)(images, prompts + ["a cat"], metadata + [{}])
    expected = [float(np.abs(images[i].astype(int) - sources[i]).mean()) for i in range(3)] + [-1.0]
    assert out["remote"].tolist() == pytest.approx(expected, rel=1e-6)
    assert [len(s) for s in server.bodies[0]["source_images"]] == [1, 1, 1, 0]  # text-to-image: []


def source_distance(images, prompts, metadata, args):
    """User reward: minus the mean absolute difference between each sample and its source (data.source_images)."""
    return [-float(np.abs(image.numpy().astype(int) - data.source_images(m)[0]).mean())
            for image, m in zip(images, metadata)]


def test_custom_reads_the_source_images_from_the_metadata(tmp_path):
    prompts, metadata, sources = edit_rows(tmp_path)
    images = sources.copy()
    images[1] = 255 - images[1]  # the second sample changed everything; the others kept their source
    out = build_reward("custom", custom_rm_path="test_rewards.source_distance")(images, prompts, metadata)
    assert out["custom"][0] == 0 and out["custom"][2] == 0 and out["custom"][1] < -50


# ----------------------------------------------------------------------------- user code, mixtures, dispatch

CALLS = []


def brightness(images, prompts, metadata, args):
    """User reward: mean pixel / 255 times the number in --custom-rm-args; records its calls."""
    CALLS.append((images.shape[0], list(prompts)))
    return images.float().mean(dim=(1, 2, 3)) / 255 * float(args or 1)


def named(images, prompts, metadata, args):
    return {"reward": [1.0] * len(prompts), "length": [float(len(p)) for p in prompts]}


def nan_for_b(images, prompts, metadata, args):
    return [float("nan") if p == "b" else 1.0 for p in prompts]


def two_entries(images, prompts, metadata, args):
    return {"a": [0.0] * len(prompts), "b": [1.0] * len(prompts)}


def test_mixture_weights_and_named_scores():
    images = random_images(3, seed=5)
    prompts = ["a", "bb", "ccc"]
    out = build_reward("custom=0.3,jpeg_compressibility=2", custom_rm_path="test_rewards.brightness", custom_rm_args="2")(
        images, prompts, None)
    bright = images.reshape(3, -1).mean(1) / 255 * 2
    assert out["custom"].tolist() == pytest.approx(bright.tolist(), rel=1e-5)
    assert out["reward"].tolist() == pytest.approx((0.3 * out["custom"] + 2 * out["jpeg_compressibility"]).tolist(), rel=1e-5)
    assert set(out) == {"custom", "jpeg_compressibility", "reward", "failed"}

    out = build_reward("custom", custom_rm_path="test_rewards.named")(images, prompts, None)
    assert out["length"].tolist() == [1.0, 2.0, 3.0] and out["reward"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="without a 'reward' entry"):
        build_reward("custom", custom_rm_path="test_rewards.two_entries")(images, prompts, None)


def test_custom_path_forms(tmp_path):
    (tmp_path / "my_reward.py").write_text("def fn(images, prompts, metadata, args):\n    return [len(args)] * len(prompts)\n")
    out = build_reward("custom", custom_rm_path=f"{tmp_path}/my_reward.py:fn", custom_rm_args="abcd")(random_images(2), ["a", "b"], None)
    assert out["reward"].tolist() == [4.0, 4.0]
    with pytest.raises(ValueError, match="--custom-rm-path 'no_such_module.fn': cannot import"):
        build_reward("custom", custom_rm_path="no_such_module.fn")
    with pytest.raises(ValueError, match="needs --custom-rm-path"):
        build_reward("custom")
    (tmp_path / "wrong.py").write_text("def two(images, prompts):\n    return [1.0] * len(prompts)\nLIMIT = 3\n")
    with pytest.raises(ValueError, match=r"--custom-rm-path '.*wrong.py:two' cannot take \(images, prompts, metadata, "
                                         r"custom_rm_args\): too many positional arguments; give it those four"):
        build_reward("custom", custom_rm_path=f"{tmp_path}/wrong.py:two")  # refused when built, not at the first step
    with pytest.raises(ValueError, match="names an object of type int, not a function"):
        build_reward("custom", custom_rm_path=f"{tmp_path}/wrong.py:LIMIT")


def test_rm_type_override_splits_and_reassembles():
    CALLS.clear()
    images = random_images(5, seed=6)
    prompts = ["p0", "p1", "p2", "p3", "p4"]
    metadata = [{}, {"rm_type": "jpeg_incompressibility"}, {"rm_type": "custom=0.5,jpeg_incompressibility=0.5"}, None,
                {"rm_type": "jpeg_incompressibility"}]
    reward = build_reward("custom", custom_rm_path="test_rewards.brightness")
    out = reward(images, prompts, metadata)
    bright = (images.reshape(5, -1).mean(1) / 255).tolist()  # plain floats: approx compares numbers, not tensors
    jpeg = make("jpeg_incompressibility")(images, prompts, metadata).tolist()
    assert CALLS == [(3, ["p0", "p2", "p3"])]  # one batched call, original order
    nan = float("nan")
    assert out["custom"].tolist() == pytest.approx([bright[0], nan, bright[2], bright[3], nan], rel=1e-5, nan_ok=True)
    assert out["jpeg_incompressibility"].tolist() == pytest.approx([nan, jpeg[1], jpeg[2], nan, jpeg[4]], rel=1e-5, nan_ok=True)
    want = [bright[0], jpeg[1], 0.5 * bright[2] + 0.5 * jpeg[2], bright[3], jpeg[4]]
    assert out["reward"].tolist() == pytest.approx(want, rel=1e-5)
    assert torch.isfinite(out["reward"]).all()


def test_unknown_names_and_options():
    with pytest.raises(ValueError, match="known rewards: pickscore, hps, ocr"):
        build_reward("ocr=0.5,pickscores=0.5")
    with pytest.raises(ValueError, match="not a number"):
        build_reward("ocr=high")
    with pytest.raises(ValueError, match="unknown reward option 'ocr_worker'; did you mean 'ocr_workers'"):
        build_reward("jpeg_compressibility", ocr_worker=3)
    reward = build_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="sample 1, metadata rm_type: unknown reward 'clip'"):
        reward(random_images(2), ["a", "b"], [{}, {"rm_type": "clip"}])


def test_nan_guard_names_reward_and_sample():
    reward = build_reward("jpeg_compressibility", custom_rm_path="test_rewards.nan_for_b")
    metadata = [{}, {"rm_type": "custom"}, {"rm_type": "custom"}]
    with pytest.raises(NonFiniteReward, match="reward 'custom' .*nan for sample 2"):
        reward(random_images(3), ["a", "a", "b"], metadata)
    assert issubclass(NonFiniteReward, ValueError)


# ----------------------------------------------------------------------------- options: one declaration

def test_options_are_declared_once_with_real_defaults():
    import argparse
    import inspect

    parser = argparse.ArgumentParser()
    rewards.add_arguments(parser)
    defaults = rewards.option_defaults()
    assert defaults == vars(parser.parse_args([])) and defaults["ocr_workers"] == 2 and defaults["reward_retries"] == 3
    for name, factory in rewards.REWARDS.items():  # each factory's options: declared flags, no defaults of their own
        own = [p for p in inspect.signature(factory).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert all(p.default is p.empty for p in own), name
        assert {p.name for p in own} <= set(defaults) | {"device"}, name
    text = " ".join(parser.format_help().split("reward:", 1)[1].split())  # the group's help, after the usage line
    for flag, default in [("--ocr-workers", "2"), ("--reward-timeout", "60.0"), ("--reward-max-bytes", str(16 * 2**20)),
                          ("--pickscore-model-path", "yuvalkirstain/PickScore_v1"), ("--rm-auth-env", "None")]:
        described = text[text.index(flag + " "):]  # --help under any formatter shows each flag's actual default
        assert described[described.index("(default: "):].startswith(f"(default: {default})"), flag
    given = vars(parser.parse_args(["--ocr-workers", "3", "--rm-auth-env", "TOKEN"]))
    assert given["ocr_workers"] == 3 and given["rm_auth_env"] == "TOKEN"


def test_eval_and_bench_take_the_reward_flags(monkeypatch, tmp_path):
    import bench
    import eval as evaluation

    seen = {}

    def fake_build_reward(spec, *, device, **options):
        seen.update(options, spec=spec)
        raise SystemExit("stop")

    monkeypatch.setattr(rewards, "build_reward", fake_build_reward)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    with pytest.raises(SystemExit, match="stop"):
        evaluation.main(["--prompts", str(prompts), "--reward", "pickscore", "--pickscore-model-path", "/models/ps"])
    assert seen["spec"] == "pickscore" and seen["pickscore_model_path"] == "/models/ps"
    assert set(seen) == set(rewards.option_defaults()) | {"spec"}
    args = bench.parse_args(["--reward", "ocr", "--ocr-workers", "4", "--", "--group-size", "4"])
    assert args.ocr_workers == 4 and args.train_args == ["--group-size", "4", "--ocr-workers", "4"]  # on to train.py


def test_build_time_checks_name_the_flag():
    for options, match in [(dict(reward_retries=0), "--reward-retries must be an integer >= 1"),
                           (dict(reward_timeout=0.0), "--reward-timeout must be a finite number > 0"),
                           (dict(remote_max_concurrency=0), "--remote-max-concurrency must be an integer >= 1"),
                           (dict(rm_url="127.0.0.1:8000"), "--rm-url must be an http:// or https:// URL")]:
        with pytest.raises(ValueError, match=match):
            build_reward("remote", **{"rm_url": "http://127.0.0.1:9", **options})
    with pytest.raises(ValueError, match="--ocr-workers must be an integer >= 1, got int 0"):
        build_reward("ocr", ocr_workers=0)


# ----------------------------------------------------------------------------- deadlines, sizes, secrets

@pytest.mark.parametrize("service", ["remote", "openai_api"])
@pytest.mark.parametrize("trickle", ["body", "head"])
def test_deadline_holds_against_a_trickling_server(service, trickle):
    """One byte every 50 ms keeps a per-read timeout happy forever; the attempt's deadline still ends it."""
    from reward_server import Raw

    if trickle == "body":
        reply = Raw(b" ", interval_s=0.05, count=80)
    else:  # the status line and headers, one byte at a time
        reply = Raw(b"", interval_s=0.05, count=0, trickle_head=True)
    with JsonServer(lambda body, headers: (200, reply, 0.0)) as server:
        options = {"rm_url": server.url} if service == "remote" else {
            "openai_api_rm_config": {"model": "m", "base_url": server.url + "/v1"}}
        reward = build_reward(service, reward_timeout=0.5, reward_retries=1, **options)
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match=f"{service}: sample 0 failed after 1 attempt.*0.5 s deadline"):
            reward(random_images(1), ["a"], None)
        elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 1.5, elapsed  # the deadline plus slack for a loaded machine, not 80 x 50 ms


def test_reply_size_is_capped_without_reading_the_rest():
    import gzip
    import tracemalloc

    from reward_server import Raw

    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 600000000\r\n\r\n"
    endless = Raw(b"7" * 65536, count=1024, head=head)  # 64 MiB of a declared 600 MB, sent as fast as it is read
    with JsonServer(lambda body, headers: (200, endless, 0.0)) as server:
        reward = build_reward("remote", rm_url=server.url, reward_max_bytes=2**20, reward_retries=1)
        tracemalloc.start()
        try:
            with pytest.raises(RewardServiceError, match=r"reply over 1048576 bytes \(--reward-max-bytes\)"):
                reward(random_images(1), ["a"], None)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # about the cap, not the 64 MiB on offer
    assert server.raw_bytes_sent < 32 * 2**20  # the client stopped reading (what is left sits in socket buffers)

    bomb = gzip.compress(json.dumps({"scores": [0.5]}).encode())  # the cap counts wire bytes: no decoding allowed
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb)
    with JsonServer(lambda body, headers: (200, Raw(bomb, count=1, head=head), 0.0)) as server:
        with pytest.raises(RewardServiceError, match="compressed"):
            build_reward("remote", rm_url=server.url, reward_retries=1)(random_images(1), ["a"], None)
    assert server.headers[0]["Accept-Encoding"] == "identity"


def test_remote_auth_header_comes_from_the_environment_and_stays_secret(monkeypatch, caplog):
    token = "Bearer rm-secret-4d1f"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValueError, match="--rm-auth-env RM_TEST_TOKEN: that environment variable is unset"):
        build_reward("remote", rm_url="http://127.0.0.1:9", rm_auth_env="RM_TEST_TOKEN")
    monkeypatch.setenv("RM_TEST_TOKEN", token)
    status = [200]

    def respond(body, headers):  # echoes the header it got in its error body, as careless servers do
        return (200, {"scores": [1.0] * len(body["prompts"])}, 0.0) if status[0] == 200 else (
            status[0], f"bad credentials {headers.get('Authorization')}", 0.0)

    with JsonServer(respond) as server:
        reward = build_reward("remote", rm_url=server.url, rm_auth_env="RM_TEST_TOKEN", **FAST)
        assert reward(random_images(2), ["a", "b"], None)["reward"].tolist() == [1.0, 1.0]
        status[0] = 500  # retried and logged at each attempt
        with pytest.raises(RewardServiceError) as err:
            reward(random_images(2), ["a", "b"], None)
    assert all(h["Authorization"] == token for h in server.headers)
    assert "failed after 3 attempt(s): _HTTPStatus: HTTP 500" in str(err.value)
    assert "bad credentials ***" in str(err.value)
    assert "retrying" in caplog.text
    for text in (str(err.value), caplog.text, repr(reward)):
        assert "rm-secret-4d1f" not in text


# ----------------------------------------------------------------------------- configs and hooks checked at build

@pytest.mark.parametrize("reward, flag", [("openai_api", "--openai-api-rm-config"),
                                          ("custom_api", "--custom-api-rm-config")])
def test_service_configs_are_checked_when_built(tmp_path, reward, flag):
    key = reward + "_rm_config"
    base = {"model": "m", "base_url": "http://127.0.0.1:9"}
    for text in ("[]", "0", '""', "- model: m"):  # YAML that is not a mapping
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{flag} must hold a YAML mapping"):
            build_reward(reward, **{key: str(path)})
    for value in (0, -1, True, 1.5):
        match = f"{flag}: max_concurrency must be an integer >= 1, got {type(value).__name__}"
        with pytest.raises(ValueError, match=match):
            build_reward(reward, **{key: {**base, "max_concurrency": value}})
    with pytest.raises(ValueError, match=f"{flag}: timeout_s must be a finite number > 0"):
        build_reward(reward, **{key: {**base, "timeout_s": "10"}})
    with pytest.raises(ValueError, match="score_min 5 must be below score_max 4"):
        build_reward(reward, **{key: {**base, "score_min": 5}})


def test_custom_api_class_and_values_are_checked():
    with pytest.raises(ValueError, match="class builtins.dict has no build_request, send_request, parse_response"):
        build_reward("custom_api", custom_api_rm_config={"class": "builtins.dict", "url": "http://127.0.0.1:9"})
    match = r"--custom-api-rm-config: reward_server.PlainScoreApi\(scale\) failed: .*'url'"  # a missing keyword
    with pytest.raises(ValueError, match=match):
        build_reward("custom_api", custom_api_rm_config={"class": "reward_server.PlainScoreApi", "scale": 2})
    for value, shown in [(True, "bool True"), ("2", "str '2'"), (None, "NoneType None")]:
        with JsonServer(lambda body, headers: (200, {"value": value}, 0.0)) as server:
            config = {"class": "reward_server.BoolScoreApi", "url": server.url}
            reward = build_reward("custom_api", custom_api_rm_config=config, reward_retries=1)
            with pytest.raises(RewardServiceError, match=f"parse_response's value is not a number: {shown}"):
                reward(random_images(1), ["a"], None)


def returns(value):
    def fn(images, prompts, metadata, args):
        return value(prompts) if callable(value) else value
    return fn


BAD_RETURNS = {
    "none": returns(None),
    "strings": returns(lambda p: ["1"] * len(p)),  # numbers in strings are refused, not parsed
    "short": returns(lambda p: [1.0]),
    "ragged": returns(lambda p: [[1.0], [1.0, 2.0]]),
    "bool_failed": returns(lambda p: {"reward": [1.0] * len(p), "failed": ["yes"] * len(p)}),
}
EXTRAS = returns(lambda p: {"reward": [1.0, 2.0], "acc_red": [float("nan"), 1.0]})
INF_EXTRA = returns(lambda p: {"reward": [1.0, 2.0], "acc_red": [float("inf"), 1.0]})


@pytest.mark.parametrize("name, match", [("none", "returned scores NoneType None; give 2 numbers"),
                                         ("strings", r"returned scores list \['1', '1'\]; give 2 numbers"),
                                         ("short", r"returned 1 scores for 2 samples: list \[1.0\]"),
                                         ("ragged", "returned scores list"),
                                         ("bool_failed", "returned 'failed' values list .*; give 2 booleans")])
def test_custom_returns_that_are_not_scores_are_one_line_errors(monkeypatch, name, match):
    monkeypatch.setattr(rewards, "_TEST_FN", BAD_RETURNS[name], raising=False)
    reward = build_reward("custom", custom_rm_path="rewards._TEST_FN")
    with pytest.raises(ValueError, match=f"--custom-rm-path rewards._TEST_FN {match}") as err:
        reward(random_images(2), ["a", "b"], None)
    assert "\n" not in str(err.value)


def test_extra_entries_may_be_nan_but_not_inf(monkeypatch):
    monkeypatch.setattr(rewards, "_TEST_FN", EXTRAS, raising=False)
    out = build_reward("custom", custom_rm_path="rewards._TEST_FN")(random_images(2), ["a", "b"], None)
    assert math.isnan(out["acc_red"][0]) and out["acc_red"][1] == 1.0  # "does not apply to this sample"
    assert out["reward"].tolist() == [1.0, 2.0]
    monkeypatch.setattr(rewards, "_TEST_FN", INF_EXTRA, raising=False)
    with pytest.raises(NonFiniteReward, match=r"reward 'custom' \(acc_red\) gave inf for sample 0"):
        build_reward("custom", custom_rm_path="rewards._TEST_FN")(random_images(2), ["a", "b"], None)


def test_raise_mode_stops_sending_after_the_first_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARD_TEST_KEY", KEY)

    def respond(body, headers):
        return 401, "{}", 0.0

    with JsonServer(respond) as server:
        config = api_config(tmp_path, server.url, max_concurrency=1)
        with pytest.raises(RewardServiceError, match="sample 0 failed after 1 attempt"):
            build_reward("openai_api", openai_api_rm_config=config)(random_images(6), PROMPTS, None)
    assert len(server.bodies) <= 2  # sample 0 fails, at most the one request already started follows
