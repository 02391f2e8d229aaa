"""Small "real" networks (any module graph) and their data, for the general-graph references.

Every model is small (<= ~250 parameters), float64-friendly and deterministically initialised
(``torch.manual_seed`` inside :func:`make_case`); normalisation layers get non-default affine
parameters (and BatchNorm non-trivial running statistics) so that they matter. Every model is
returned in eval mode (the evidence is computed in eval mode anyway).

  cnn_bn_res     Conv2d -> BatchNorm2d -> ReLU -> [Conv2d -> BatchNorm2d] + skip -> tanh -> pool -> Linear
  mlp_ln         Linear -> LayerNorm -> tanh -> Linear -> LayerNorm -> tanh -> Linear
  tokens_gn      Embedding(padding_idx=0) -> Linear -> GroupNorm -> tanh -> mean over positions -> Linear
  tokens_ln      the same with LayerNorm
  conv1d         Conv1d('same') -> tanh -> Conv1d(groups=2, stride 2, dilation 2) -> tanh -> mean -> Linear
  conv2d_grouped Conv2d -> tanh -> Conv2d(groups=2, stride 2, dilation 2, padding 2) -> tanh
                 -> Conv2d(1x1, groups=2) -> pool -> Linear
  seq_out        Embedding -> Linear per position -> LayerNorm -> tanh -> causal cumulative mean
                 -> Linear head: outputs (B, T, C)
  tokens_dict    forward(input_ids, attention_mask): tokens_ln with a masked mean (dict inputs)
  tokens_twin    the same network taking one tensor (B, 2, T) = stack(input_ids, attention_mask)
  frozen_head    frozen Linear/tanh backbone + trainable Linear head
  lora           frozen Linear W (and bias) + trainable low-rank A, B (nn.Linear, no bias):
                 out = W x + b + B(A x); two such layers with a tanh and a trainable LayerNorm between
  shared         weight-tied token model: Embedding also used as the output projection
                 (F.linear), a Linear called twice, a raw nn.Parameter, one ordinary Linear

``make_case(name, kind, n)`` gives (model, inputs, targets); inputs are a tensor or a dict.
Regression targets are noisy model outputs; classification targets random classes; sequence
targets (``seq_out``) have ``IGNORE`` at padded and at some random positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tests.reference import call

IGNORE = -100
VOCAB, SEQ_LEN = 9, 5


def _perturb_affine(*norms: nn.Module, gen_scale: float = 0.3) -> None:
    """Non-default affine parameters (and running statistics) so that the norm layers matter."""
    with torch.no_grad():
        for norm in norms:
            norm.weight.add_(gen_scale * torch.randn_like(norm.weight))
            norm.bias.add_(gen_scale * torch.randn_like(norm.bias))
            if isinstance(norm, nn.modules.batchnorm._BatchNorm):
                norm.running_mean.copy_(0.5 * torch.randn_like(norm.running_mean))
                norm.running_var.copy_(0.5 + torch.rand_like(norm.running_var))


# --------------------------------------------------------------------------------------------
# (1) CNN with BatchNorm and a residual connection
# --------------------------------------------------------------------------------------------


class CnnBnRes(nn.Module):
    """1x6x6 -> 3x6x6 -> residual block -> 3x3x3 (avg pool) -> out."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.head = nn.Linear(27, n_out)
        _perturb_affine(self.bn1, self.bn2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = torch.tanh(h + self.bn2(self.conv2(h)))
        return self.head(F.avg_pool2d(h, 2).flatten(1))


# --------------------------------------------------------------------------------------------
# (2) MLP with LayerNorm
# --------------------------------------------------------------------------------------------


class MlpLn(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(4, 7), nn.LayerNorm(7)
        self.fc2, self.ln2 = nn.Linear(7, 6), nn.LayerNorm(6)
        self.fc3 = nn.Linear(6, n_out)
        _perturb_affine(self.ln1, self.ln2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.ln1(self.fc1(x)))
        h = torch.tanh(self.ln2(self.fc2(h)))
        return self.fc3(h)


# --------------------------------------------------------------------------------------------
# (3) token model, (7) its dict-input masked variant and tensor twin
# --------------------------------------------------------------------------------------------


class Tokens(nn.Module):
    """Embedding(padding_idx=0) -> Linear (per position: T rows) -> norm -> tanh -> mean -> Linear."""

    def __init__(self, n_out: int, norm: str = "layer") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, padding_idx=0)
        self.proj = nn.Linear(4, 6)
        self.norm_kind = norm
        self.norm = nn.LayerNorm(6) if norm == "layer" else nn.GroupNorm(2, 6)
        self.head = nn.Linear(6, n_out)
        _perturb_affine(self.norm)

    def features(self, input_ids: Tensor) -> Tensor:
        h = self.proj(self.emb(input_ids))  # (B, T, 6)
        if self.norm_kind == "layer":
            h = self.norm(h)
        else:  # GroupNorm normalises (B, C, T)
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return torch.tanh(h)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.features(input_ids).mean(1))


class TokensDict(Tokens):
    """forward(input_ids, attention_mask): masked mean over the positions (HF-style dict inputs)."""

    def __init__(self, n_out: int) -> None:
        super().__init__(n_out, "layer")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # type: ignore[override]
        h = self.features(input_ids)
        mask = attention_mask.to(h.dtype).unsqueeze(-1)
        return self.head((h * mask).sum(1) / mask.sum(1).clamp(min=1))


class TokensTwin(TokensDict):
    """The same network on one tensor x = stack(input_ids, attention_mask) of shape (B, 2, T)."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(input_ids=x[:, 0], attention_mask=x[:, 1])


# --------------------------------------------------------------------------------------------
# (4) Conv1d on sequences, (5) grouped/strided/dilated Conv2d
# --------------------------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    """(B, 2, 10) -> Conv1d same -> (B, 4, 10) -> Conv1d(groups 2, stride 2, dilation 2, pad 2) -> (B, 4, 5)."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3, padding="same")
        self.conv2 = nn.Conv1d(4, 4, 3, stride=2, dilation=2, padding=2, groups=2)
        self.head = nn.Linear(4, n_out)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(h.mean(-1))


class Conv2dGrouped(nn.Module):
    """2x7x7 -> 4x7x7 -> (groups 2, stride 2, dilation 2, pad 2) 4x4x4 -> (1x1, groups 2) 6x4x4 -> 6x2x2."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, dilation=2, padding=2, groups=2)
        self.conv3 = nn.Conv2d(4, 6, 1, groups=2)
        self.head = nn.Linear(24, n_out)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(F.avg_pool2d(self.conv3(h), 2).flatten(1))


# --------------------------------------------------------------------------------------------
# (6) sequence outputs (B, T, C)
# --------------------------------------------------------------------------------------------


class SeqOut(nn.Module):
    """Embedding -> Linear per position -> LayerNorm -> tanh -> causal cumulative mean -> Linear head."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, padding_idx=0)
        self.proj = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, n_out)
        _perturb_affine(self.norm)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.proj(self.emb(input_ids))))  # (B, T, 5)
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype).reshape(1, -1, 1)
        return self.head(h.cumsum(1) / steps)  # (B, T, n_out)


# --------------------------------------------------------------------------------------------
# (8) frozen backbone + head; LoRA adapters
# --------------------------------------------------------------------------------------------


class FrozenHead(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh())
        self.head = nn.Linear(6, n_out)
        self.backbone.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class LoRALinear(nn.Module):
    """out = W x + b + B(A x): W, b frozen; A (rank x in), B (out x rank) trainable nn.Linear without bias."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        with torch.no_grad():  # non-zero B: otherwise A's curvature vanishes at init
            self.lora_b.weight.copy_(0.5 * torch.randn_like(self.lora_b.weight))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRA(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.l1 = LoRALinear(4, 7)
        self.norm = nn.LayerNorm(7)
        self.l2 = LoRALinear(7, n_out)
        _perturb_affine(self.norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.norm(self.l1(x))))


# --------------------------------------------------------------------------------------------
# shared / reused weights (diagonal blocks in the hybrid structure)
# --------------------------------------------------------------------------------------------


class Shared(nn.Module):
    """emb.weight is also the output projection (tied: used outside the Embedding call), ``mix``
    is called twice, ``gain`` is a raw parameter; only ``proj`` gets Kronecker blocks."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.proj = nn.Linear(4, 4)
        self.mix = nn.Linear(4, 4)
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(4))
        self.n_out = n_out

    def forward(self, input_ids: Tensor) -> Tensor:
        h = torch.tanh(self.proj(self.emb(input_ids))).mean(1)
        h = torch.tanh(self.mix(torch.tanh(self.mix(h)))) * self.gain
        return F.linear(h, self.emb.weight)[:, : self.n_out]


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def token_ids(n: int, gen: torch.Generator, min_len: int = 2) -> Tuple[Tensor, Tensor]:
    """ids (n, T) in [1, VOCAB) followed by padding 0, and the attention mask (n, T) (long)."""
    lengths = torch.randint(min_len, SEQ_LEN + 1, (n,), generator=gen)
    mask = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=gen) * mask
    return ids, mask


@dataclass
class Net:
    build: Callable[[int], nn.Module]
    inputs: Callable[[int, torch.Generator], object]
    sequence: bool = False  # outputs (B, T, C)


def _dense(*shape: int) -> Callable[[int, torch.Generator], Tensor]:
    return lambda n, gen: torch.randn((n,) + shape, generator=gen)


NETWORKS: Dict[str, Net] = {
    "cnn_bn_res": Net(CnnBnRes, _dense(1, 6, 6)),
    "mlp_ln": Net(MlpLn, _dense(4)),
    "tokens_gn": Net(lambda c: Tokens(c, "group"), lambda n, gen: token_ids(n, gen)[0]),
    "tokens_ln": Net(lambda c: Tokens(c, "layer"), lambda n, gen: token_ids(n, gen)[0]),
    "conv1d": Net(Conv1dNet, _dense(2, 10)),
    "conv2d_grouped": Net(Conv2dGrouped, _dense(2, 7, 7)),
    "seq_out": Net(SeqOut, lambda n, gen: token_ids(n, gen)[0], sequence=True),
    "tokens_dict": Net(TokensDict, lambda n, gen: dict(zip(("input_ids", "attention_mask"), token_ids(n, gen)))),
    "tokens_twin": Net(TokensTwin, lambda n, gen: torch.stack(token_ids(n, gen), 1)),
    "frozen_head": Net(FrozenHead, _dense(4)),
    "lora": Net(LoRA, _dense(4)),
    "shared": Net(Shared, lambda n, gen: token_ids(n, gen)[0]),
}
N_OUT = {"regression": 2, "classification": 3}


def make_model(name: str, kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return NETWORKS[name].build(N_OUT[kind]).double().eval()


def make_case(name: str, kind: str, n: int = 20, seed: int = 0):
    """(model, inputs, targets): the model from ``seed``, the data from ``seed + 1``.

    ``tokens_dict`` and ``tokens_twin`` with the same seed are the same network on the same data.
    Sequence targets: ``IGNORE`` at padded positions and at ~20% of the others (classification);
    Gaussian sequence targets (B, T, D) everywhere.
    """
    net = NETWORKS[name]
    model = make_model(name, kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "tokens_twin":  # the dict variant's data, stacked
        inputs = dict(zip(("input_ids", "attention_mask"), token_ids(n, gen)))
        inputs = torch.stack([inputs["input_ids"], inputs["attention_mask"]], 1)
    else:
        inputs = net.inputs(n, gen)
    with torch.no_grad():
        f = call(model, inputs)
    if kind == "regression":
        return model, inputs, f + 0.8 * torch.randn(f.shape, generator=gen)
    y = torch.randint(0, f.shape[-1], f.shape[:-1], generator=gen)
    if net.sequence:
        ignore = (inputs == 0) | (torch.rand(y.shape, generator=gen) < 0.2)
        y = torch.where(ignore, torch.full_like(y, IGNORE), y)
    return model, inputs, y


def batches(inputs, y: Tensor, batch_size: int):
    """A list of (inputs, targets) batches (works for dict inputs, unlike TensorDataset)."""
    n = y.shape[0]
    out = []
    for lo in range(0, n, batch_size):
        sl = slice(lo, min(lo + batch_size, n))
        if isinstance(inputs, dict):
            out.append(({k: v[sl] for k, v in inputs.items()}, y[sl]))
        else:
            out.append((inputs[sl], y[sl]))
    return out
