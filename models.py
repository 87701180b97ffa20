"""The networks the scripts train, and build_model: put your own model here (or import it in
the script in build_model's place). Nothing in it is distributed: each strategy's script
cuts, shards or wraps these plain modules itself."""

import contextlib
import hashlib
import math
import random
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


def seed_everything(seed):
    """The same initial weights wherever a model is built: on every rank, in every layout."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def name_seed(seed, name):
    """One tensor's seed, from the run's seed and the tensor's name alone."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63, as manual_seed takes


def default_draw(module, attr):
    """PyTorch's own initialisation of the layer types the transformers use."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):  # kaiming_uniform(a=sqrt(5)); the bias alike
        return "uniform", 1 / math.sqrt(math.prod(module.weight.shape[1:]))
    if isinstance(module, nn.Embedding):
        return "normal", 1.0
    if isinstance(module, nn.LayerNorm):  # scale 1, shift 0
        return "constant", float(attr == "weight")
    raise ValueError(f"no initialisation for {type(module).__name__}.{attr}")


def initial_tensor(model, name, seed):
    """The initial value of `name` (a parameter of `model`, which may be on the meta device,
    sharded or one pipeline stage: only its shapes and layer types are read), drawn whole on
    the CPU from a generator seeded by (seed, name) alone. So a process draws the tensors it
    holds pieces of, one at a time, and cuts its pieces from the same values one process
    starts from, whatever the layout: no process builds the whole model. (DTensor's own RNG
    would draw only the pieces, but not the same values at every layout, and on a CPU mesh
    not even different ones on different ranks.) The distribution: the module's `init_draws`
    entry for it (GPT-2's spreads, the experts'), else PyTorch's default for its type."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    like = getattr(module, attr)
    kind, scale = getattr(module, "init_draws", {}).get(attr) or default_draw(module, attr)
    out = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    if kind == "normal":
        return out.normal_(0, scale, generator=generator)
    if kind == "uniform":
        return out.uniform_(-scale, scale, generator=generator)
    return out.fill_(scale)


@torch.no_grad()
def init_weights(model, seed=None):
    """Every parameter of `model`, built whole, drawn by initial_tensor; seed: the one given to
    torch.manual_seed (seed_everything's), so a model built after it starts from the weights
    every sharded layout fills its pieces with. Nothing on the meta device: no memory."""
    seed = torch.initial_seed() if seed is None else seed
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            param.copy_(initial_tensor(model, name, seed))


def initial_weights(build, seed):
    """name -> the whole initial tensor of that name as one process built with `seed` holds it:
    the transformers' (marked by init_draws) each drawn alone by initial_tensor; the image
    networks, whose layers draw in turn from torch's one generator, built whole on the CPU
    (they are small: at most ResNet-18's 11 M parameters)."""
    with torch.device("meta"):
        shapes = build()
    if hasattr(shapes, "init_draws"):
        return lambda name: initial_tensor(shapes, name, seed)
    seed_everything(seed)
    return build().state_dict().__getitem__


class SmallCNN(nn.Sequential):
    """Three conv-BN-ReLU-maxpool blocks and a linear head; narrow, for CPUs."""

    def __init__(self, in_channels=1, num_classes=10, widths=(16, 32, 64)):
        layers = []
        for c, w in zip((in_channels, *widths), widths, strict=False):  # no bias: BatchNorm's
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)]
            layers += [nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        head = [nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(widths[-1] * 9, num_classes)]
        super().__init__(OrderedDict(features=nn.Sequential(*layers), head=nn.Sequential(*head)))


def resnet18_small(in_channels, num_classes):
    """torchvision's ResNet-18 for small images: a 3x3 stride-1 stem and no max-pool, so a
    28x28 or 32x32 input is not shrunk to 7x7 before the first block."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class AirbenchNet(nn.Sequential):
    """airbench94's network (Jordan, 2024, KellerJordan/cifar10-airbench: 94% on CIFAR-10 in
    3.83 s on an A100), without its data-dependent whitening init: a 2x2 convolution, then
    three groups that pool early (conv, max-pool, BatchNorm, GELU, conv, BatchNorm, GELU;
    widths 64, 256, 256), so most convolutions run on 13x13 maps or smaller; a max-pool over
    the last 3x3 and a linear head whose logits are scaled by 1/9, as airbench's."""

    def __init__(self, in_channels=1, num_classes=10, widths=(64, 256, 256), first=24):
        layers = [nn.Conv2d(in_channels, first, 2), nn.GELU()]
        for c, w in zip((first, *widths), widths, strict=False):
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.MaxPool2d(2)]
            layers += [nn.BatchNorm2d(w), nn.GELU(), nn.Conv2d(w, w, 3, padding=1, bias=False)]
            layers += [nn.BatchNorm2d(w), nn.GELU()]
        head = nn.Linear(widths[-1], num_classes, bias=False)
        super().__init__(*layers, nn.AdaptiveMaxPool2d(1), nn.Flatten(), head)

    def forward(self, x):
        return super().forward(x) / 9


class MirrorAveraged(nn.Module):
    """A classifier evaluated on each image and its mirror, the mean of the two logits
    (test-time flips, as airbench evaluates): for a model trained with flips (--augment); to
    one trained without them a mirror is an image it never saw, and the mean is worse."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return (self.model(x) + self.model(x.flip(-1))) / 2


class MLP(nn.Sequential):
    """Two linear layers, no BatchNorm or dropout: with it, DDP's result equals one process on
    the whole batch up to float rounding (BatchNorm normalises over each rank's batch)."""

    def __init__(self, in_channels=1, num_classes=10, hidden=256, size=28):
        first = nn.Linear(in_channels * size * size, hidden)
        super().__init__(nn.Flatten(), first, nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))


# --sdpa-backend: the kernels F.scaled_dot_product_attention may pick on a GPU, in this order.
# auto: cuDNN's first on Hopper (compute capability 9), where it trains fastest
# (pytorch/pytorch#142132; benchmarks/gpu/mfu.py measures it), PyTorch's own order elsewhere.
SDPA_BACKENDS = dict(flash="FLASH_ATTENTION", efficient="EFFICIENT_ATTENTION")
SDPA_BACKENDS.update(cudnn="CUDNN_ATTENTION", math="MATH")


def sdpa_order(name, capability, cudnn):
    """The SDPBackend names --sdpa-backend `name` allows on a GPU of `capability` (with cuDNN
    or not), in priority order; None: PyTorch's choice. A named kernel alone: no fallback."""
    if name == "auto":
        hopper = capability[0] == 9 and cudnn
        return (
            [SDPA_BACKENDS[k] for k in ("cudnn", "flash", "efficient", "math")] if hopper else None
        )
    return None if name == "default" else [SDPA_BACKENDS[name]]


def attention_kernels(name, q):
    """A context that lets F.scaled_dot_product_attention on q use sdpa_order's kernels; on
    the CPU (its own kernels, every CPU figure as it was) and for "default", no change."""
    if name == "default" or not (isinstance(q, torch.Tensor) and q.is_cuda):  # fx's Proxy: no
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn = torch.backends.cudnn.is_available()
    order = sdpa_order(name, torch.cuda.get_device_capability(q.device), cudnn)
    if order is None:
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, k) for k in order], set_priority=True)


class Attention(nn.Module):
    """Multi-head self-attention with q, k, v and the output projection as four Linears
    (tensor parallelism splits each of them, and with them the heads)."""

    kernels = "default"  # --sdpa-backend (training.sharded_args sets it): see SDPA_BACKENDS

    def __init__(self, dim, heads, causal=False):
        super().__init__()
        self.head_dim, self.causal = dim // heads, causal
        # attend(q, k, v): F.scaled_dot_product_attention unless set (context_parallel.py sets
        # attention over every process's keys and values)
        self.attend = None
        self.q, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(3))
        # No key bias: it adds one constant to a query's scores, which softmax ignores, so its
        # gradient is zero plus rounding noise (that Adam would scale up to full steps).
        self.k = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        def heads(y):  # (N, tokens, heads * head_dim) -> (N, heads, tokens, head_dim)
            # -1: the heads this process holds (all unless a tensor-parallel plan split them)
            return y.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.attend:
            out = self.attend(q, k, v)
        else:  # causal: each token attends to itself and the tokens before it, not after
            with attention_kernels(self.kernels, q):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim, heads, mlp_ratio=4, causal=False):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        hidden = mlp_ratio * dim
        self.mlp = nn.Sequential(
            OrderedDict(fc1=nn.Linear(dim, hidden), act=nn.GELU(), fc2=nn.Linear(hidden, dim))
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small Vision Transformer (Dosovitskiy et al., 2021): each patch of the image a token,
    pre-norm blocks (the units that FSDP shards and tensor parallelism splits), the tokens'
    mean, a linear head."""

    def __init__(
        self, in_channels=1, num_classes=10, size=28, dim=96, depth=4, heads=4, patch=None
    ):
        super().__init__()
        # patch: (height, width) of a token's pixels; default 4 x 4 tokens
        ph, pw = patch or (max(1, size // 4),) * 2
        self.patch_embed = nn.Conv2d(in_channels, dim, (ph, pw), stride=(ph, pw))
        self.pos = nn.Parameter(torch.empty(1, (size // ph) * (size // pw), dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)
        # PyTorch's defaults, and the positions N(0, 0.02); each tensor seeded by its name.
        self.init_draws = dict(pos=("normal", 0.02))
        init_weights(self)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos  # (N, tokens, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class GPT(nn.Module):
    """A causal decoder over bytes (Radford et al., 2019, at a small size): each byte a token
    with a learned position, the ViT's pre-norm blocks with causal attention, a final norm
    and a head to 256 logits: at each position, the distribution of the next byte."""

    def __init__(self, vocab=256, seq_len=256, dim=96, depth=4, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.empty(1, seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, causal=True) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        # GPT-2's initialisation (as nanoGPT's _init_weights): every weight N(0, 0.02), biases
        # 0, so the first logits are near 0 and the first loss near a uniform guess, ln 256.
        # PyTorch's default (uniform, 1/sqrt(fan_in)) starts above it, sure of wrong bytes.
        # Each tensor drawn from a generator seeded by its name (initial_tensor).
        self.init_draws = dict(pos=("normal", 0.02))
        for module in self.modules():  # LayerNorm keeps its scale 1 and shift 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.init_draws = dict(weight=("normal", 0.02), bias=("constant", 0.0))
        # Each block adds its attention's and its MLP's output to the residual stream: 2 x depth
        # sums whose variance grows with the depth unless the last layer of each (proj, fc2)
        # starts 1/sqrt(2 x depth) smaller (GPT-2, section 2.3).
        # One change: q and k N(0, 1/sqrt(dim)), so that each score q.k / sqrt(head_dim) starts
        # with variance 1, as attention's scaling assumes (Vaswani et al., 2017, 3.2.1). Under
        # 0.02 at width 128 they start with variance 0.003 (each byte attends almost evenly to
        # those before it) and q's and k's gradients, each scaled by the other, are as small:
        # attention forms late (benchmarks/results.md).
        for block in self.blocks:
            for last in (block.attn.proj, block.mlp.fc2):
                last.init_draws["weight"] = ("normal", 0.02 / math.sqrt(2 * depth))
            for scorer in (block.attn.q, block.attn.k):
                scorer.init_draws["weight"] = ("normal", 1 / math.sqrt(dim))
        init_weights(self)

    def forward(self, x):  # (N, T) bytes -> (N, T, vocab); a pipeline stage: see keep_stage
        if self.embed is not None:  # the first stage (or the whole model)
            x = self.embed(x) + self.pos[:, : x.shape[1]]
        for block in filter(None, self.blocks):  # the blocks this stage holds
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


def keep_stage(gpt, start, end):
    """Cut a GPT in place to one pipeline stage: blocks [start, end), the embedding and
    positions if it is the first stage (start 0), the final norm and the head if the last.
    What it does not hold becomes None, so what it holds keeps the whole model's names
    (blocks.5.mlp.fc1.weight at any cut: a checkpoint loads into any other number of stages),
    as torchtitan's pipeline_llama deletes the layers a stage does not own."""
    depth = len(gpt.blocks)
    for i in [*range(start), *range(end, depth)]:
        gpt.blocks[i] = None
    if start > 0:
        gpt.embed = gpt.pos = None
    if end < depth:
        gpt.norm = gpt.head = None
    return gpt


@torch.no_grad()
def generate(model, state=None, prompt="def ", length=300, temperature=0.8, seed=0):
    """`prompt` and `length` more bytes from a GPT (with the weights `state`, if given), each
    drawn from its distribution of the next byte given the seq_len bytes before it, with a
    generator of its own: the same text every time."""
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt.encode())])
    for _ in range(length):
        logits = model(tokens[:, -model.pos.shape[1] :])[0, -1].float()
        probs = (logits / temperature).softmax(-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)[None]], 1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


MATRICES = (nn.Linear, nn.Conv2d)  # the layers whose weight decays


def param_groups(model, weight_decay):
    """AdamW's two groups, as GPT-2 is trained (nanoGPT's configure_optimizers): weight decay
    on the matrices that multiply activations (Linear and convolution weights; a module may
    name more in `decayed`, as expert_parallel.py's experts do), none on biases, norms, the
    embedding or the positions: decay pulls a weight towards 0, right for a matrix (a smaller
    norm, a smoother function), wrong for a norm's scale (towards 0, not 1) or a table row."""
    decayed = set()
    for module in model.modules():
        names = getattr(module, "decayed", ("weight",) if isinstance(module, MATRICES) else ())
        decayed.update(id(getattr(module, name)) for name in names)
    params = list(model.parameters())
    return [
        dict(params=[p for p in params if id(p) in decayed], weight_decay=weight_decay),
        dict(params=[p for p in params if id(p) not in decayed], weight_decay=0.0),
    ]


MODELS = {"cnn": SmallCNN, "resnet18": resnet18_small, "mlp": MLP, "vit": ViT}
MODELS["airbench"] = AirbenchNet


def build_model(
    name, in_channels, num_classes, image_size=28, dim=96, heads=4, seq_len=256, depth=4
):
    """An image model of MODELS, or "gpt" (on text: num_classes is the vocabulary). dim, heads
    and depth (blocks) shape the transformers (vit, gpt), seq_len the GPT's context."""
    if name == "gpt":
        return GPT(num_classes, seq_len, dim, depth, heads)
    if name == "vit":
        return ViT(in_channels, num_classes, image_size, dim, depth, heads)
    if name == "mlp":  # its first layer's shape depends on the image size
        return MLP(in_channels, num_classes, size=image_size)
    return MODELS[name](in_channels, num_classes)


def build_pipeline_cnn(in_channels, num_classes, widths=(32, 64, 128), hidden=128):
    """model_parallel.py's small CNN, unlike build_model's a flat nn.Sequential of 5 blocks
    that stages are cut from. GroupNorm, not BatchNorm: per sample, so micro-batches change
    nothing. Stride 2, not max-pooling, whose ties flip with rounding. No in-place ReLU: a
    stage's input is a received buffer autograd keeps."""
    layers = []
    for c, w in zip((in_channels, *widths[:-1]), widths, strict=True):
        conv = nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False)
        layers.append(nn.Sequential(conv, nn.GroupNorm(8, w), nn.ReLU()))
    head = [nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(widths[-1] * 9, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Sequential(*head), nn.Linear(hidden, num_classes))
