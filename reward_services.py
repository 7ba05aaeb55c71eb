"""Rewards that ask a service: a factory of `rewards.REWARDS` each, scoring over HTTP on services.py's loop.

    openai_api      a vision-language judge behind a Chat Completions endpoint (`OpenAIJudge`, a rubric, 0-4)
    custom_api      your request/response hooks in the same loop (a class with build_request, send_request and
                    parse_response; `OpenAIJudge` is one)
    remote          a reward server you run: one POST per batch, the protocol below
    unifiedreward   UnifiedReward's "Final Score" from your vLLM / SGLang server (`UnifiedRewardJudge`)
    Soft-TIFA       `soft_tifa_server`: GenEval 2's questions to a server, read from top_logprobs (the reward is
                    rewards.soft_tifa, whose other backends run in this process)

Every service runs on services.py: a thread pool of at most `max_concurrency` requests in flight (per process), one
deadline per attempt for everything (name lookup, connect, send, the whole reply: `timeout_s` of the config, else
`--reward-timeout`), a cap on the reply (`--reward-max-bytes`), retries with exponential backoff, and
`reward_on_error="raise"` (stop with `RewardServiceError` naming the service, the sample and the attempts made) or
`"skip"` (the sample is marked in `failed` and gets reward 0). Secrets (the judge's `api_key_env`, `--rm-auth-env`)
are read from the environment when the reward is built and never appear in logs, errors or args.json: every error
line is masked (`services.mask_secrets`). The `openai_api` judge uses the official `openai` client on services'
transport, with its own retries off: one retry loop serves every service alike.

The `remote` protocol (POST to `--rm-url`, Content-Type application/json, and with `--rm-auth-env NAME` the header
`Authorization: <value of $NAME>`):

    request:  {"prompts":  ["a cat", ...],                       # B strings
               "metadata": [{...}, ...],                         # B JSON objects
               "images":   ["<base64 PNG>", ...],                # B strings; video: B lists of frames
               "source_images": [["<base64 PNG>", ...], ...]}    # B lists: each sample's sources ([] if none)
    response: {"scores":   [0.71, ...]}                          # B finite numbers, same order

`custom_api` imports and runs user code named by a dotted path: only point it at code you trust. The names a hook
uses are here and in rewards: `post_json`, `http_client`, `BadReply`, `OpenAIJudge`.
"""
import json
import math
import os

import torch

import data  # a sample's source images (edits): data.source_images(metadata)
import flags
import reward_models
import services  # the HTTP plumbing
from reward_models import png_base64, to_uint8
from services import (  # noqa: F401  (post_json, http_client, BadReply, load_config: the names hooks use)
    BadReply, _HTTPStatus, _http_url, _number, _serve, _service_loop, http_client, load_config, post_json)


# ----------------------------------------------------------------------------- the judge, your hooks, your server

DEFAULT_RUBRIC = """You grade an image generated from a text prompt. Rate how well the image shows \
what the prompt asks for and how well it is made, on this scale:
4: every element of the prompt is present and correct, and the image has no visible flaws.
3: the main subject and most details are right; small errors or artifacts.
2: the main subject is recognisable, but important details are missing or wrong.
1: barely related to the prompt, or badly distorted.
0: unrelated to the prompt, or not a coherent image.
Reply with JSON only, exactly of the form {"score": <number>}."""


EDIT_RUBRIC = """You grade an image edit. You see the source image(s), then the edited image, and the edit \
instruction. Rate how well the edited image carries out the instruction while keeping everything the \
instruction does not ask to change, on this scale:
4: the instruction is carried out exactly and nothing else changed; no visible flaws.
3: the instruction is carried out, with small unwanted changes or artifacts.
2: the instruction is partly carried out, or carried out with clear unwanted changes.
1: barely any of the instruction is carried out, or the image is badly distorted.
0: the instruction is ignored, or the result is unrelated to the source.
Reply with JSON only, exactly of the form {"score": <number>}."""


class OpenAIJudge:
    """One image, one Chat Completions request: system rubric + generation prompt + PNG data URL;
    for an edit (a sample with source images) the rubric is EDIT_RUBRIC unless the config gives one,
    and the source images come first, each a PNG data URL after the text "Source image k:", then
    "Edited image:" and the sample;
    the reply's message content must be JSON `{"score": <number>}` inside [score_min, score_max]
    (a ```json fence around it is tolerated). The key comes from the environment variable
    `api_key_env` and is kept out of repr, logs and errors. Requests go through the official
    `openai` client on `http_client`'s transport, with its retries off (the service loop retries).

    The three methods are the hooks `custom_api` calls: subclass this (or write any class with
    them) and name it under `class` in `--custom-api-rm-config`.
    """

    def __init__(self, *, model, api_key_env=None, base_url="https://api.openai.com/v1", prompt=None,
                 score_min=0.0, score_max=4.0, temperature=0.0, max_tokens=64):
        import openai

        self._key = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise ValueError(f"the environment variable {api_key_env} (api_key_env) is not set; "
                                 f"export the API key in it")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must name the judge model, got {flags.show(model)}")
        self.model, self.url = model, _http_url(base_url, "base_url").rstrip("/")
        self.prompt = DEFAULT_RUBRIC if prompt is None else prompt
        self.edit_prompt = EDIT_RUBRIC if prompt is None else prompt
        self.score_min, self.score_max = flags.real(score_min, "score_min"), flags.real(score_max, "score_max")
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min {score_min} must be below score_max {score_max}")
        self.temperature = flags.real(temperature, "temperature", minimum=0)
        self.max_tokens = flags.integer(max_tokens, 1, "max_tokens")
        # No key (a server without auth): a placeholder keeps OPENAI_API_KEY unread and each request omits the header.
        self._client = openai.OpenAI(api_key=self._key or "none", base_url=self.url, max_retries=0,
                                     http_client=http_client())
        self._headers = None if self._key else {"Authorization": openai.Omit()}

    def __repr__(self):
        return f"{type(self).__name__}(model={self.model!r}, url={services.redact_urls(self.url)!r})"

    def redact(self, text):
        return services.mask_secrets([self._key, *services.url_secrets(self.url)])(services.redact_urls(text))

    def build_request(self, image, prompt, metadata):
        if image.ndim != 3:
            raise ValueError(f"{type(self).__name__} scores images only, got frames of shape {image.shape}")

        def png(a):
            return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(a)}}

        content = [{"type": "text", "text": f"Prompt: {prompt}"}, png(image)]
        sources = data.source_images(metadata)
        if sources:  # an edit: the judge sees what it started from, then the result
            content = [content[0]] + [part for k, source in enumerate(sources, 1)
                                      for part in ({"type": "text", "text": f"Source image {k}:"}, png(source))]
            content += [{"type": "text", "text": "Edited image:"}, png(image)]
        return {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "messages": [
                {"role": "system", "content": self.edit_prompt if sources else self.prompt},
                {"role": "user", "content": content},
            ],
        }

    def send_request(self, request, timeout):
        """The Chat Completions reply as a dict. HTTP errors keep their status (for the retry rule); a failure
        without one (deadline, byte cap, refused connection) is raised as what caused it."""
        import openai

        try:
            reply = self._client.chat.completions.create(**request, timeout=timeout, extra_headers=self._headers)
        except openai.APIStatusError as err:
            raise _HTTPStatus(err.status_code, f"HTTP {err.status_code}: {err.response.text[:300]}") from None
        except openai.APIConnectionError as err:  # its own message is only "Connection error." / "Request timed out."
            raise (err.__cause__ or err) from None
        except ValueError as err:  # a body that is not JSON
            raise BadReply(f"reply is not JSON ({err})") from None
        return reply.model_dump() if hasattr(reply, "model_dump") else reply  # a non-JSON body comes back as str

    def parse_response(self, response):
        try:
            content = response["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BadReply(f"not a Chat Completions reply: {str(response)[:200]}") from None
        text = (content or "").strip()
        if text.startswith("```"):
            text = text.strip("`").removeprefix("json").strip()
        try:
            reply = json.loads(text)
        except ValueError:
            raise BadReply(f'message is not JSON {{"score": <number>}}: {text[:200]!r}') from None
        if not isinstance(reply, dict) or "score" not in reply:
            raise BadReply(f'message is not JSON {{"score": <number>}}: {text[:200]!r}')
        value = _number(reply["score"], "score")
        if not self.score_min <= value <= self.score_max:
            raise BadReply(f"score {value} outside [{self.score_min}, {self.score_max}]")
        return value


HOOKS = ("build_request", "send_request", "parse_response")


def _api_scorer(service, client, loop):
    """The request/response loop shared by `openai_api` and `custom_api`: one request per sample."""
    redact = getattr(client, "redact", lambda s: s)

    def send(request):
        value = client.parse_response(client.send_request(request, loop["timeout"]))
        return [_number(value, "parse_response's value")]  # True or "2" are refused, not read as 1.0 or 2.0

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        scores, failed = _serve(service, [[i] for i in range(len(images))],
                                prepare=lambda u: client.build_request(images[u], prompts[u], metadata[u]),
                                send=lambda u, request: send(request), redact=redact, **loop)
        return {"reward": scores, "failed": failed}

    return score


def _config_loop(flag, config, timeout, *options):
    """The loop settings of a config-driven service: its keys `timeout_s` (else --reward-timeout) and
    `max_concurrency` (8) are popped from `config`; `options` are the retries, backoff, on_error and byte cap."""
    timeout_name = f"{flag}: timeout_s" if "timeout_s" in config else "--reward-timeout"
    return _service_loop(config.pop("timeout_s", timeout), timeout_name, config.pop("max_concurrency", 8),
                         f"{flag}: max_concurrency", *options)


def _construct(cls, config, flag, name):
    try:
        return cls(**config)
    except (TypeError, ValueError) as err:  # a missing, unknown or bad key
        raise ValueError(f"{flag}: {name}({', '.join(sorted(config))}) failed: {err}") from None


def openai_api(*, openai_api_rm_config, reward_timeout, reward_retries, reward_backoff, reward_on_error,
               reward_max_bytes, **_):
    """A vision-language judge behind an OpenAI-compatible Chat Completions endpoint (`OpenAIJudge`).

    Config keys: model, api_key_env, base_url, prompt | prompt_path, score_min (0), score_max (4),
    temperature (0), max_tokens (64), timeout_s (--reward-timeout), max_concurrency (8, per process).
    """
    flag = "--openai-api-rm-config"
    config = load_config(openai_api_rm_config, flag)
    known = ("model", "api_key_env", "base_url", "prompt", "score_min", "score_max", "temperature", "max_tokens",
             "timeout_s", "max_concurrency")
    unknown = sorted(set(config) - set(known))
    if unknown or "model" not in config:
        raise ValueError(f"{flag}: unknown keys {unknown} or no model; keys are {sorted(known) + ['prompt_path']}")
    loop = _config_loop(flag, config, reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    return _api_scorer("openai_api", _construct(OpenAIJudge, config, flag, "OpenAIJudge"), loop)


def custom_api(*, custom_api_rm_config, reward_timeout, reward_retries, reward_backoff, reward_on_error,
               reward_max_bytes, **_):
    """Your request/response hooks in the `openai_api` loop. Runs user code.

    Config: `class` (dotted path to a class with build_request(image uint8 [H, W, 3], prompt,
    metadata) -> request, send_request(request, timeout) -> response, parse_response(response) ->
    number; default `rewards.OpenAIJudge`), timeout_s, max_concurrency; every other key is passed
    to the class as a keyword. A `redact(text)` method, if present, filters its error messages.
    `send_request` gets the deadline and the byte cap of the attempt when it posts with
    `rewards.post_json` (or a `rewards.http_client()`); other HTTP code only gets `timeout`.
    """
    flag = "--custom-api-rm-config"
    config = load_config(custom_api_rm_config, flag)
    path = config.pop("class", "rewards.OpenAIJudge")
    cls = flags.import_object(path, f"{flag} class")
    loop = _config_loop(flag, config, reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    client = _construct(cls, config, flag, path)
    missing = [hook for hook in HOOKS if not callable(getattr(client, hook, None))]
    if missing:
        raise ValueError(f"{flag}: class {path} has no {', '.join(missing)}; it needs build_request, send_request "
                         f"and parse_response (see rewards.OpenAIJudge)")
    return _api_scorer("custom_api", client, loop)


def remote(*, rm_url, rm_auth_env, remote_batch_size, remote_max_concurrency, reward_timeout, reward_retries,
           reward_backoff, reward_on_error, reward_max_bytes, **_):
    """A reward server you run: the protocol in the module docstring. The batch goes in one POST,
    or in chunks of `remote_batch_size` samples with at most `remote_max_concurrency` in flight.
    With `rm_auth_env`, that environment variable's value is the Authorization header."""
    if not rm_url:
        raise ValueError("reward 'remote' needs --rm-url http://host:port/path")
    _http_url(rm_url, "--rm-url")
    batch_size = flags.integer(remote_batch_size, 0, "--remote-batch-size")
    loop = _service_loop(reward_timeout, "--reward-timeout", remote_max_concurrency, "--remote-max-concurrency",
                         reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    headers, redact = _secret_header(rm_auth_env, "--rm-auth-env", lambda token: token,
                                     f"export the Authorization header value in it, e.g. {rm_auth_env}='Bearer <token>'",
                                     url=rm_url)
    client = http_client(headers)  # the header lives in the client only: not in args, logs or errors

    def send(body):
        reply = post_json(rm_url, body, timeout=loop["timeout"], client=client)
        if not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
            raise BadReply(f'expected {{"scores": [...]}}, got {str(reply)[:200]}')
        return [_number(s, "score") for s in reply["scores"]]

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        size = batch_size or len(images)
        units = [list(range(i, min(i + size, len(images)))) for i in range(0, len(images), size)]

        def prepare(u):
            pngs = [png_base64(images[i]) if images.ndim == 4 else [png_base64(f) for f in images[i]]
                    for i in units[u]]
            return {"prompts": [prompts[i] for i in units[u]], "metadata": [metadata[i] for i in units[u]],
                    "images": pngs,  # the samples; and each one's source images, [] for text-to-image
                    "source_images": [[png_base64(a) for a in data.source_images(metadata[i])] for i in units[u]]}

        scores, failed = _serve("remote", units, prepare, lambda u, body: send(body), redact=redact, **loop)
        return {"reward": scores, "failed": failed}

    return score


# ----------------------------------------------------------------------------- UnifiedReward (an openai_api preset)

# The pointwise image-generation prompt of the authors (CodeGoat24/UnifiedReward,
# inference_qwen/image_generation/qwen_point_score_image_generation.py; MixGRPO's QUESTION_TEMPLATE_SCORE is the
# same), as the model was trained to read it; {prompt} is the caption.
UNIFIEDREWARD_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image using the "
    "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and assign a "
    "score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)


class UnifiedRewardJudge(OpenAIJudge):
    """UnifiedReward (Wang et al., arXiv:2503.05236) served behind an OpenAI-compatible endpoint, e.g.
    `vllm serve CodeGoat24/UnifiedReward-qwen-7b --served-model-name UnifiedReward --port 8080` (the authors'
    vllm_qwen/vllm_server.sh) or SGLang. One request per image, as the authors' client sends it: a single user
    message holding the image, then `UNIFIEDREWARD_PROMPT` with the caption; temperature 0, up to 4096 tokens.

    The reply is free text: element lines, then "Final Score: <n>". The score is the number after the last
    "Final Score:" (markdown bold around it is allowed), 1 to 5. A reply without one is a failed attempt (retried,
    then --reward-on-error), where Flow-GRPO's unifiedreward_score_sglang scores it 0; Flow-GRPO also divides the
    score by 5 (a constant factor that group normalisation removes).
    """

    def __init__(self, *, model, base_url, api_key_env=None, max_tokens=4096):
        super().__init__(model=model, base_url=base_url, api_key_env=api_key_env, prompt=UNIFIEDREWARD_PROMPT,
                         score_min=1.0, score_max=5.0, temperature=0.0, max_tokens=max_tokens)

    def build_request(self, image, prompt, metadata):
        if image.ndim != 3:
            raise ValueError(f"unifiedreward scores images only, got frames of shape {image.shape}")
        question = self.prompt.replace("{prompt}", prompt)
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(image)}},
                    {"type": "text", "text": question}]}]}

    def parse_response(self, response):
        import re

        try:
            text = response["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise BadReply(f"not a Chat Completions reply: {str(response)[:200]}") from None
        # the whole number, exponent included: "4.9e10" is out of range, not 4.9
        # a decimal comma is a decimal point: "4,5" is 4.5, not 4 (a comma and a space end the number: "4, as")
        found = re.findall(r"Final Score:\s*\**\s*([0-9]+(?:[.,][0-9]+)?(?:[eE][+-]?[0-9]+)?)", text)
        if not found:
            raise BadReply(f"no 'Final Score: <n>' in the reply: {text[-200:]!r}")
        value = float(found[-1].replace(",", "."))
        if not self.score_min <= value <= self.score_max:
            raise BadReply(f"Final Score {value:g} outside [{self.score_min:g}, {self.score_max:g}]")
        return value


def unifiedreward(*, unifiedreward_url, unifiedreward_model, unifiedreward_api_key_env, unifiedreward_max_concurrency,
                  reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes, **_):
    """UnifiedReward's pointwise score, 1-5, from a server you run (`UnifiedRewardJudge`), through the request
    loop of `openai_api`: deadline, retries, bounded concurrency and --reward-on-error apply alike. Images only."""
    _http_url(unifiedreward_url, "--unifiedreward-url")
    loop = _service_loop(reward_timeout, "--reward-timeout", unifiedreward_max_concurrency,
                         "--unifiedreward-max-concurrency", reward_retries, reward_backoff, reward_on_error,
                         reward_max_bytes)
    if not isinstance(unifiedreward_model, str) or not unifiedreward_model:
        raise ValueError(f"--unifiedreward-model must name the served model, got {flags.show(unifiedreward_model)}")
    try:
        judge = UnifiedRewardJudge(model=unifiedreward_model, base_url=unifiedreward_url,
                                   api_key_env=unifiedreward_api_key_env)
    except ValueError as err:  # the key's environment variable is unset
        raise ValueError(f"--unifiedreward-api-key-env: {err}") from None
    return _api_scorer("unifiedreward", judge, loop)


# ----------------------------------------------------------------------------- Soft-TIFA's server backend
# (GenEval 2's judge; the reward is rewards.soft_tifa)

def soft_tifa_logprob(reply, answers):
    """A question's probability from a Chat Completions reply asked with max_tokens 1, logprobs and top_logprobs: the
    sum of exp(logprob) over the first token's top_logprobs entries whose token text is one of `answers`
    (reward_models.soft_tifa_answers). An answer the server did not list (below its top k) counts 0: the sum falls
    short by at most (answers not listed) x (the smallest probability listed). A reply without top_logprobs, or whose
    entries are not log-probabilities (NaN, above 0, or adding up to more than 1), is a BadReply, never a number."""
    try:
        entries = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise BadReply(f"no choices[0].logprobs.content[0].top_logprobs in the reply ({str(reply)[:200]}); the "
                       f"server must return log-probabilities (vLLM does for logprobs/top_logprobs)") from None
    if not isinstance(entries, list) or not entries:
        raise BadReply(f"top_logprobs holds no entries ({flags.show(entries)}); the server must list top_logprobs")
    total = found = 0.0
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise BadReply(f"a top_logprobs entry is not {{'token': str, 'logprob': number}}: {flags.show(entry)}")
        logprob = _number(entry.get("logprob"), f"the logprob of token {entry['token']!r}")
        if math.isnan(logprob) or logprob > 1e-6:
            raise BadReply(f"the logprob of token {entry['token']!r} is {logprob}, not a log-probability (<= 0)")
        total += math.exp(logprob)
        found += math.exp(logprob) if entry["token"] in answers else 0.0
    if total > 1 + 1e-3:
        raise BadReply(f"the top_logprobs entries' probabilities add up to {total:.4f} > 1: not one distribution")
    return min(found, 1.0)


def _secret_header(env, flag, header, hint, url=None):
    """({"Authorization": header(secret)}, a redactor of the secret and of `url`'s user:password) from the environment
    variable `env`, or no header without one; an unset or empty variable is refused in one line naming `flag` and
    `hint`."""
    mask = services.mask_secrets(services.url_secrets(url))
    if not env:
        return {}, (lambda s: mask(services.redact_urls(s)))
    secret = os.environ.get(env)
    if not secret:
        raise ValueError(f"{flag} {env}: that environment variable is unset or empty; {hint}")
    mask = services.mask_secrets([secret, *services.url_secrets(url)])
    return {"Authorization": header(secret)}, lambda s: mask(services.redact_urls(s))


def soft_tifa_server(*, url, model, api_key_env, top_logprobs, loop):
    """Soft-TIFA's questions to an OpenAI-compatible server (vLLM: `vllm serve Qwen/Qwen3-VL-8B-Instruct`), one
    Chat Completions request per question: the user turn of reward_models.soft_tifa_vlm (the image as a PNG data URL,
    then the question and SOFT_TIFA_SUFFIX), temperature 0, max_tokens 1, logprobs with `top_logprobs` entries; the
    probability is `soft_tifa_logprob`'s. Requests run in services' loop (deadline, retries, at most max_concurrency
    in flight); a question that fails for good fails its sample (--reward-on-error)."""
    _http_url(url, "--soft-tifa-url")
    headers, redact = _secret_header(api_key_env, "--soft-tifa-api-key-env", lambda key: f"Bearer {key}",
                                     "export the server's API key in it", url=url)
    client, endpoint = http_client(headers), url.rstrip("/") + "/chat/completions"

    def ask(images, vqa):
        pngs = [png_base64(image) for image in images]  # once per sample, for all its questions
        jobs = [(i, k) for i, pairs in enumerate(vqa) for k in range(len(pairs))]

        def prepare(u):
            i, k = jobs[u]
            return {"model": model, "temperature": 0.0, "max_tokens": 1, "logprobs": True,
                    "top_logprobs": top_logprobs, "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + pngs[i]}},
                        {"type": "text", "text": vqa[i][k][0] + reward_models.SOFT_TIFA_SUFFIX}]}]}

        def send(u, request):
            i, k = jobs[u]
            reply = post_json(endpoint, request, timeout=loop["timeout"], client=client)
            return [soft_tifa_logprob(reply, reward_models.soft_tifa_answers(*vqa[i][k]))]

        def label(unit):
            i, k = jobs[unit[0]]
            return f"sample {i}, question {k} ({vqa[i][k][0]!r})"

        probs, failed = _serve("soft_tifa", [[u] for u in range(len(jobs))], prepare, send, redact=redact,
                               label=label, **loop)
        counts = [len(pairs) for pairs in vqa]
        return (list(probs.double().split(counts)),
                torch.tensor([bool(f.any()) for f in failed.split(counts)], dtype=torch.bool))

    return ask
