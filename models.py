"""The networks the scripts train, and build_model: put your own model here (or import it in
the script in build_model's place). Nothing in it is distributed: each strategy's script
cuts, shards or wraps these plain modules itself."""

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


class MLP(nn.Sequential):
    """Two linear layers, no BatchNorm or dropout: with it, DDP's result equals one process on
    the whole batch up to float rounding (BatchNorm normalises over each rank's batch)."""

    def __init__(self, in_channels=1, num_classes=10, hidden=256, size=28):
        first = nn.Linear(in_channels * size * size, hidden)
        super().__init__(nn.Flatten(), first, nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))


class Attention(nn.Module):
    """Multi-head self-attention with q, k, v and the output projection as four Linears
    (tensor parallelism splits each of them, and with them the heads)."""

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
        self.pos = nn.Parameter(0.02 * torch.randn(1, (size // ph) * (size // pw), dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

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
        nn.init.normal_(self.pos, std=0.02)
        for module in self.modules():  # LayerNorm keeps its scale 1 and shift 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
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
                nn.init.normal_(last.weight, std=0.02 / math.sqrt(2 * depth))
            for scorer in (block.attn.q, block.attn.k):
                nn.init.normal_(scorer.weight, std=1 / math.sqrt(dim))

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
