"""A learned proxy of an exact GenEval judge: a small network that reads an image and its prompt's GenEval metadata and
gives the probability that the judge calls the image correct. Trained on the shapes world (shapes/world.py), where the
judge is exact, so that RL on the proxy can be watched hacking it (the exact judge logged beside it as the truth).

    nets = load("weights/shapes_proxy.safetensors")      # the ensemble's members, ProxyNet each, in eval mode
    p = probability(nets[0], images, metadata)          # images uint8 [B, H, W, 3] -> [B] float in [0, 1]
    save(nets, path, note="...")                        # what scripts/train_shapes_proxy.py writes

The prompt enters as its metadata, not its text (a bag of words could not tell "a red circle and a blue square" from
"a blue circle and a red square", nor which shape is left of which). `encode` gives each of the (at most two)
include clauses a slot of one-hot fields, in clause order:

    class   [C]  the file's classes (shapes.SHAPES when trained on the shapes world)
    count   [4]  1-4
    colour  [K]  the file's colours; all zero: any colour
    relation[R]  geneval.RELATIONS, to the clause its position names; all zero: none
    exact   [1]  an exclude clause caps the class at this count (GenEval's counting prompts: count + 1 excluded)

so every prompt of GenEval's six templates has its own code, and the tag is implied (counting is the exact bit; the
judge's stricter counting threshold, geneval.COUNTING_THRESHOLD, follows from it). A second slot left empty is zeros.

The network (ProxyNet) first maps what is where: a small CNN gives per cell of a half-resolution map the class, the
colour and an object density whose sum counts objects; then each clause of the code is asked of the maps (how many
objects of its class and colour, where their centroid is) and an MLP turns the answers into the verdict's logit.
The maps are learned from the exact detector's masks beside the verdict (a network that had to find counting and
relations from 0/1 verdicts alone, a FiLM-conditioned CNN, agreed with the judge on 0.63 of held-out renders after
7,500 labelled images); what they see is learned, so RL can still find images that fool them.

The file holds one or more members (an ensemble: each trained from its own seed), float16 like the shapes model's
weights (half the size; the network runs in float32), the tensors of member k under "k.<name>", and in the
safetensors metadata the classes, colours, sizes and a note saying how it was made.
"""
import itertools
import json
import os

import torch
from torch import nn

import flags
import geneval

FORMAT = "shapes_proxy/1"  # the safetensors metadata "format" of a proxy file
MAX_CLAUSES = 2  # include clauses a prompt may have: GenEval's templates have one or two
MAX_COUNT = 4  # the largest count a clause may ask for (the shapes world draws 1-4 objects)
WEIGHTS = "weights/shapes_proxy.safetensors"


def slot_width(classes, colors):
    return len(classes) + MAX_COUNT + len(colors) + len(geneval.RELATIONS) + 1


def encode(metadata, classes, colors):
    """GenEval metadata rows -> their codes, float [B, MAX_CLAUSES x slot_width] (module docstring). A row this
    encoding cannot hold (a class or colour outside `classes` / `colors`, more than two include clauses, a count over
    MAX_COUNT, an exclude clause that is not a cap on an included class) is a one-line ValueError."""
    width, offsets = slot_width(classes, colors), _offsets(classes, colors)
    out = torch.zeros(len(metadata), MAX_CLAUSES * width)
    for row, m in enumerate(metadata):
        geneval.check_metadata(m, vocabulary=(tuple(classes), tuple(colors)), detector="proxy's")
        include = m["include"]
        if len(include) > MAX_CLAUSES:
            raise ValueError(f"the proxy reads at most {MAX_CLAUSES} include clauses, the row has {len(include)}: "
                             f"{str(m)[:120]}")
        caps = {(c["class"], c["count"]) for c in m.get("exclude", [])}
        for i, clause in enumerate(include):
            if clause["count"] > MAX_COUNT:
                raise ValueError(f"the proxy reads counts 1-{MAX_COUNT}, include clause {i} asks for "
                                 f"{clause['count']}: {str(m)[:120]}")
            base = i * width
            out[row, base + offsets["class"] + classes.index(clause["class"])] = 1
            out[row, base + offsets["count"] + clause["count"] - 1] = 1
            if "color" in clause:
                out[row, base + offsets["color"] + colors.index(clause["color"])] = 1
            if "position" in clause:  # the relation to the only other clause there can be: the first
                out[row, base + offsets["relation"] + geneval.RELATIONS.index(clause["position"][0])] = 1
            if (clause["class"], clause["count"] + 1) in caps:
                out[row, base + offsets["exact"]] = 1
        included = {(c["class"], c["count"] + 1) for c in include}
        if caps - included:
            raise ValueError(f"the proxy reads an exclude clause only as a cap on an included class (count + 1, as "
                             f"GenEval's counting prompts), not {sorted(caps - included)}: {str(m)[:120]}")
    return out


def _offsets(classes, colors):
    sizes = [("class", len(classes)), ("count", MAX_COUNT), ("color", len(colors)),
             ("relation", len(geneval.RELATIONS)), ("exact", 1)]
    starts = itertools.accumulate([n for _, n in sizes], initial=0)
    return {name: start for (name, _), start in zip(sizes, starts)}


class ProxyNet(nn.Module):
    """Maps of what is where, then the prompt's questions asked of them -> the logit of "the judge calls it correct".

    A CNN (three 3 x 3 convolutions, the first at stride 2, the last dilated: 15 px seen) gives, per cell of a map at
    half the image's side, the logits of the class there (the file's classes, then background, then a blob that is no
    class), of its colour, and an object density (softplus): a sum of one bump per object at its centre, so that its
    sum over a region counts the objects there (Lempitsky & Zisserman 2010, "Learning to count objects in images").
    For each include clause of the code (class a, colour k or any): matching density = density x P(a) x P(k); its
    sum n (the matching objects), the sum without the colour, their differences from the clause's count, and the
    matching density's centroid. The head (an MLP) reads these, the offset between the two clauses' centroids, the
    total density and the code itself. The maps are trained beside the verdict on the exact detector's masks
    (scripts/train_shapes_proxy.py), which is what makes a few thousand images enough; the head learns the
    rules from the verdicts alone."""

    def __init__(self, classes, colors, *, resolution=32, width=32, hidden=64):
        super().__init__()
        if resolution % 2:
            raise ValueError(f"the proxy's image side must be even, got {resolution}")
        self.classes, self.colors = tuple(classes), tuple(colors)
        self.resolution, self.width, self.hidden = resolution, width, hidden
        self.trunk = nn.Sequential(nn.Conv2d(3 + 2, width, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.ReLU())  # 15 px seen
        self.out = nn.Conv2d(width, len(classes) + 2 + len(colors) + 1, 1)  # class (+ background, blob), colour,
        # density
        with torch.no_grad():  # density about 0.02 a cell (a few objects per image) at the start, not 0.7: from 0.7 the
            self.out.bias[-1] = -4.0  # first steps' pull to 0 left softplus at saturation, no gradient, no density
        code = MAX_CLAUSES * slot_width(classes, colors)
        self.head = nn.Sequential(nn.Linear(MAX_CLAUSES * 7 + 3 + code, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def config(self):
        return dict(classes=list(self.classes), colors=list(self.colors), resolution=self.resolution,
                    width=self.width, hidden=self.hidden)

    def maps(self, images):
        """uint8 [B, H, W, 3] -> (class logits [B, C + 2, h, w], colour logits [B, K, h, w], density [B, h, w]),
        h = H / 2."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1  # [B, 3, H, W] in [-1, 1]
        y = self.out(self.trunk(torch.cat([x, _coords(x)], 1)))  # CoordConv (Liu et al. 2018)
        c = len(self.classes) + 2
        return y[:, :c], y[:, c:-1], nn.functional.softplus(y[:, -1])

    def forward(self, images, code):
        """images uint8 [B, H, W, 3], code float [B, D] (encode) -> logits [B]."""
        return self.judge(*self.maps(images), code)

    def judge(self, class_logits, color_logits, density, code):
        p_class, p_color = class_logits.softmax(1), color_logits.softmax(1)  # [B, C + 2, h, w], [B, K, h, w]
        xy = _coords(density[:, None])  # [B, 2, h, w]
        width, offsets = slot_width(self.classes, self.colors), _offsets(self.classes, self.colors)
        n_class, counts = len(self.classes), torch.arange(1.0, MAX_COUNT + 1, device=code.device)
        features, centres = [], []
        for i in range(MAX_CLAUSES):
            slot = code[:, i * width:(i + 1) * width]
            cls, color = slot[:, :n_class], slot[:, offsets["color"]:offsets["color"] + len(self.colors)]
            count = slot[:, offsets["count"]:offsets["count"] + MAX_COUNT] @ counts
            present = cls.sum(1)  # [B]: 0 for an empty slot
            of_class = density * torch.einsum("bc,bchw->bhw", cls, p_class[:, :n_class])  # [B, h, w]
            match = of_class * (torch.einsum("bk,bkhw->bhw", color, p_color) + 1 - color.sum(1)[:, None, None])
            n, n_any = match.sum((1, 2)), of_class.sum((1, 2))  # [B]: matching objects; of the class, any colour
            centre = (match[:, None] * xy).sum((2, 3)) / (n[:, None] + 1e-3)  # [B, 2]
            features += [f * present for f in (n, n_any, n - count, n_any - count, (n - count).abs(), *centre.T)]
            centres.append(centre * present[:, None])
        offset = (centres[1] - centres[0]) * present[:, None]  # [B, 2]: clause 1 seen from clause 0 (its target)
        x = torch.cat([torch.stack(features, 1), offset, density.sum((1, 2))[:, None], code], 1)
        return self.head(x).squeeze(1)  # [B]


def _coords(x):
    """x and y in [-1, 1] over the map of x [B, C, H, W] -> [B, 2, H, W]."""
    b, _, h, w = x.shape
    ys = torch.linspace(-1, 1, h, device=x.device).view(1, 1, h, 1).expand(b, 1, h, w)
    xs = torch.linspace(-1, 1, w, device=x.device).view(1, 1, 1, w).expand(b, 1, h, w)
    return torch.cat([xs, ys], 1)


def logits(net, images, metadata):
    """The member's logits [B] of uint8 images [B, H, W, 3] (numpy or torch) for their GenEval metadata."""
    images = torch.as_tensor(images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"the proxy takes uint8 images [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    if tuple(images.shape[1:3]) != (net.resolution, net.resolution):
        raise ValueError(f"the proxy was trained on {net.resolution} x {net.resolution} images, got "
                         f"{images.shape[1]} x {images.shape[2]}: score images of the shapes world's size")
    if len(metadata) != len(images):
        raise ValueError(f"the proxy got {len(images)} images and {len(metadata)} metadata rows")
    device = next(net.parameters()).device
    return net(images.to(device), encode(metadata, net.classes, net.colors).to(device))


@torch.no_grad()
def probability(net, images, metadata, *, batch_size=256):
    """P(correct) per image, float [B] on the CPU, in batches of batch_size."""
    parts = [torch.sigmoid(logits(net, images[i:i + batch_size], metadata[i:i + batch_size])).cpu()
             for i in range(0, len(images), batch_size)]
    return torch.cat(parts) if parts else torch.zeros(0)


def save(nets, path, *, note=""):
    """Write the members `nets` (one architecture) to a safetensors file, float16, their config in the metadata."""
    from safetensors.torch import save_file

    config = nets[0].config()
    if any(net.config() != config for net in nets):
        raise ValueError("the members of one proxy file must share one architecture and vocabulary")
    state = {f"{k}.{name}": value.detach().cpu().half().contiguous()
             for k, net in enumerate(nets) for name, value in net.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    save_file(state, tmp, metadata={"format": FORMAT, "members": str(len(nets)), "config": json.dumps(config),
                                    "note": note})
    os.replace(tmp, path)  # a crash never leaves a half-written file under the name


def load(path, *, device="cpu", flag="--shapes-proxy-path"):
    """The members of a proxy file, each a ProxyNet in eval mode on `device` (float32). A relative path that does
    not exist from here is looked up from the repository (as the shipped shapes model). A missing or foreign file is
    a one-line error naming `flag`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = flags.shipped(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no proxy weights there; the repository ships {WEIGHTS} (git checkout "
                                f"it) and scripts/train_shapes_proxy.py writes new ones")
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # not a safetensors file at all
        raise ValueError(f"{flag} {path} is not a safetensors file ({type(err).__name__}); write one with "
                         "scripts/train_shapes_proxy.py") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{flag} {path} holds no proxy weights (its format is {meta.get('format')!r}, not "
                         f"{FORMAT!r}); write them with scripts/train_shapes_proxy.py")
    state, config = load_file(path), json.loads(meta["config"])
    nets = []
    for k in range(int(meta["members"])):
        net = ProxyNet(**config)
        mine = {name[len(f"{k}."):]: value.float() for name, value in state.items() if name.startswith(f"{k}.")}
        net.load_state_dict(mine)
        nets.append(net.to(device).eval().requires_grad_(False))
    return nets


# ----------------------------------------------------------------------------- the reward

def add_arguments(parser):
    """The options of the `shapes_proxy` rewards (rewards.add_arguments wires them in)."""
    group = parser.add_argument_group("shapes_proxy reward")
    group.add_argument("--shapes-proxy-path", default=WEIGHTS,
                       help="safetensors file of the learned proxy (scripts/train_shapes_proxy.py): the reward "
                            "shapes_proxy scores with its member 0, shapes_proxy_<k> with member k "
                            "(default: %(default)s)")
    return group


def member_reward(member):
    """The factory of the reward `shapes_proxy` (member 0) or `shapes_proxy_<k>` (member k; rewards.REWARDS): each
    image's probability that the exact judge calls it correct, as member `member` of --shapes-proxy-path predicts it,
    [B] in [0, 1].

    Several members in one --reward (weighted 0 where they are only watched) are independent judges of the same
    images: GARDO's gate can rank against them (train.py --gardo-gate shapes_proxy_1,shapes_proxy_2)."""
    name = "shapes_proxy" if member == 0 else f"shapes_proxy_{member}"

    def factory(*, shapes_proxy_path, device, **_):
        nets = load(shapes_proxy_path, device=device)
        if member >= len(nets):
            raise ValueError(f"reward {name} scores with member {member} of --shapes-proxy-path {shapes_proxy_path}, "
                             f"which holds {len(nets)}: train more with scripts/train_shapes_proxy.py "
                             f"--ensemble {member + 1}, or name fewer members")
        net = nets[member]
        return lambda images, prompts, metadata: probability(net, images, list(metadata))

    factory.__name__ = name
    return factory
