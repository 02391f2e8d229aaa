"""The callback at the sizes users train on a GPU (issue 54, item 3), for ``benchmarks/gpu.py --real-sizes``.

Models, built from configs (no downloads): ResNet-18 (torchvision, its stem made CIFAR's: a 3x3 stride-1
convolution, no max-pool) on 32x32 generated images, 10 classes; a ViT-tiny (timm's ``VisionTransformer`` at
ViT-Ti's width 192, depth 12 and 3 heads, patches of 4 on 32x32 images, 10 classes); GPT-2 small (12 layers, 768
wide) with its 50,257-token vocabulary and an untied head, frozen but for peft LoRA adapters (rank 8 on
``c_attn``) and the head, on next-token prediction of generated token sequences.

Per model, in one process and in this order: a warm-up fit of two batches (kernels, allocator); a plain fit of
one epoch (``MapModule``: the same MAP loss with the prior fixed at delta = 1, no callback); a fit of one epoch with
``MargLikCallback()`` at its defaults, whose schedule estimates after a fit's last epoch whatever its ``frequency``:
its set-up, training epoch and one estimate are measured apart; then ``"auto"``'s choice between the exact and
the one-sample Monte-Carlo GGN (:data:`lightning_marglik.curvature.estimator.EXACT_COLUMNS`, set from CPU
timings): both evidence passes on the first ``crossover_batches`` batches against as many training steps, at
the model's classes and (ResNet-18) with heads of more classes.

Clock and memory (:class:`Meter`): on CUDA wall seconds after ``torch.cuda.synchronize`` and
``torch.cuda.max_memory_allocated``; on the CPU process CPU seconds (one thread) and peak RSS (``VmHWM``); the peak
is reset before each phase. The whole-run ratio at the defaults' frequency F = 10 is computed from the parts:
``(F x epoch with the callback + estimate) / (F x plain epoch)``.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from _common import reset_peak_rss, rss_mib
from common import MapModule

MODELS = ("resnet18", "vit_tiny", "gpt2_lora")
FREQUENCY = 10  # MargLikCallback's default: an estimate every 10th epoch
TARGET = 1.3  # issue 54: a default run at most 1.3x a plain run on the GPU
CLASSES = 10
VOCABULARY = 50_257
LORA_RANK = 8
LR = 1e-3


@dataclass(frozen=True)
class Size:
    """How much data each model sees, and what the crossover measures."""

    images: int
    image_batch: int
    sequences: int
    tokens: int
    token_batch: int
    crossover_batches: int
    sweep_classes: Tuple[int, ...]  # ResNet-18 heads of more classes than 10 (exact GGN: classes - 1 columns)


SIZES = {
    # a minute or two on one CPU thread (the test runs it)
    "small": Size(images=32, image_batch=16, sequences=4, tokens=16, token_batch=2, crossover_batches=1,
                  sweep_classes=(3,)),
    # issue 54's: N = 50,000 images; 4,096 sequences of 128 tokens
    "full": Size(images=50_000, image_batch=128, sequences=4_096, tokens=128, token_batch=16, crossover_batches=20,
                 sweep_classes=(21, 51)),
}


# --- models and data ----------------------------------------------------------------------------


def resnet18(classes: int = CLASSES) -> nn.Module:
    """torchvision's ResNet-18 with CIFAR's stem (a 3x3 stride-1 convolution, no max-pool) for 32x32 images."""
    import torchvision

    net = torchvision.models.resnet18(num_classes=classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def vit_tiny(classes: int = CLASSES) -> nn.Module:
    """ViT-Ti (width 192, depth 12, 3 heads) on 32x32 images in patches of 4: 64 tokens and a class token."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=32, patch_size=4, num_classes=classes, embed_dim=192, depth=12, num_heads=3)


class LanguageModel(nn.Module):
    """A Hugging Face causal LM as a module returning logits ``(B, T, V)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits


def gpt2_lora() -> nn.Module:
    """GPT-2 small with the 50,257-token vocabulary and an untied head; learnable: LoRA on ``c_attn`` and the head."""
    import peft
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCABULARY, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                                     tie_word_embeddings=False)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
                                                target_modules=["c_attn"], fan_in_fan_out=True))
    model.base_model.model.lm_head.weight.requires_grad_(True)  # a trained head, as a fine-tune to a new task has
    return LanguageModel(model)


BUILDERS = {"resnet18": resnet18, "vit_tiny": vit_tiny, "gpt2_lora": gpt2_lora}


def dataset(model: str, size: Size, seed: int = 0, classes: int = CLASSES) -> Tuple[TensorDataset, int]:
    """Generated data for ``model`` and its N (images, or predicted tokens)."""
    g = torch.Generator().manual_seed(seed)
    if model == "gpt2_lora":
        tokens = torch.randint(0, VOCABULARY, (size.sequences, size.tokens + 1), generator=g)
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), size.sequences * size.tokens
    images = torch.randn(size.images, 3, 32, 32, generator=g)
    return TensorDataset(images, torch.randint(0, classes, (size.images,), generator=g)), size.images


def batch_size(model: str, size: Size) -> int:
    return size.token_batch if model == "gpt2_lora" else size.image_batch


def module_of(model: str, n_data: int, seed: int = 0) -> MapModule:
    from lightning_marglik import CategoricalLikelihood, GaussianPrior

    torch.manual_seed(seed)
    net = BUILDERS[model]()
    prior = GaussianPrior(net)
    prior.record_n_data(n_data)
    return MapModule(net, prior, CategoricalLikelihood(), n_data, LR)


# --- measuring ------------------------------------------------------------------------------------


class Meter:
    """The device's clock and peak memory: on CUDA wall seconds after a synchronize and the allocator's peak; on
    the CPU process CPU seconds and the process's peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started = 0.0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        if self.cuda:
            return ("wall seconds after torch.cuda.synchronize; peak memory: torch.cuda.max_memory_allocated, reset "
                    "before each phase")
        return "process CPU seconds, one thread; peak memory: the process's peak RSS (VmHWM), reset before each phase"

    def _clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()
        self._started = self._clock()

    def stop(self) -> Dict[str, float]:
        """Seconds and peak MiB since :meth:`start`."""
        seconds = self._clock() - self._started
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else rss_mib("VmHWM")
        return {"seconds": seconds, "peak_mib": peak}


class Phases(pl.Callback):
    """A fit's phases, each measured by ``meter`` from the end of the one before: ``setup`` (up to the first
    training epoch), ``epoch`` (the training epoch), ``estimate`` (what the callbacks between this one and
    :attr:`after` do at the epoch's end: ``MargLikCallback``'s estimate). Put this first and ``after`` last."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.rows: Dict[str, Dict[str, float]] = {}
        phases = self

        class After(pl.Callback):
            def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                phases.record("estimate")

        self.after = After()

    def record(self, phase: str) -> None:
        self.rows[phase] = self.meter.stop()
        self.meter.start()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record("setup")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record("epoch")


def fit(module: MapModule, data: TensorDataset, batch: int, meter: Meter, callback: Optional[pl.Callback] = None,
        batches: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """One epoch of ``module`` (the first ``batches`` batches, if given) with ``callback``: its phases."""
    from lightning_marglik.selection import quiet_lightning

    phases = Phases(meter)
    callbacks = [phases, *([callback] if callback is not None else []), phases.after]
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    with quiet_lightning(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the library's notes (tied or frozen tensors, the cost check) are not measured
        trainer = pl.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, devices=1,
                             accelerator="gpu" if meter.cuda else "cpu", limit_train_batches=batches)
        if meter.cuda:
            torch.cuda.empty_cache()
        meter.start()
        trainer.fit(module, loader)
    return phases.rows


def _pass_seconds(net: nn.Module, batches: List[Tuple[Tensor, Tensor]], mc_samples: int, meter: Meter) -> float:
    """One evidence pass (kron, GGN) over ``batches``."""
    from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

    prior, likelihood = GaussianPrior(net).to(meter.device), CategoricalLikelihood().to(meter.device)
    meter.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LaplaceEvidence.fit(net, batches, likelihood, prior, "kron", "ggn", mc_samples,
                            generator=torch.Generator().manual_seed(0))
    return meter.stop()["seconds"]


def _steps_seconds(net: nn.Module, batches: List[Tuple[Tensor, Tensor]], meter: Meter) -> float:
    """As many training steps (Adam on the cross-entropy) as ``batches``."""
    trained = copy.deepcopy(net)
    optimizer = torch.optim.Adam([p for p in trained.parameters() if p.requires_grad], lr=LR)
    meter.start()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(trained(x).flatten(0, -2), y.flatten()).backward()
        optimizer.step()
    return meter.stop()["seconds"]


def crossover(model: str, size: Size, meter: Meter) -> List[Dict[str, Any]]:
    """The exact and the one-sample GGN's evidence pass over the first ``size.crossover_batches`` batches, each in
    as many training steps, at the model's classes and (ResNet-18) at ``size.sweep_classes``. GPT-2's exact GGN
    (``tokens x 50,256`` columns a batch) is not run."""
    rows = []
    for classes in (CLASSES, *size.sweep_classes) if model == "resnet18" else (CLASSES,):
        data, _ = dataset(model, size, seed=1, classes=classes)
        torch.manual_seed(0)
        net = (resnet18(classes) if model == "resnet18" else BUILDERS[model]()).to(meter.device)
        k, b = size.crossover_batches, batch_size(model, size)
        batches = [tuple(t[i * b:(i + 1) * b].to(meter.device) for t in data.tensors) for i in range(k)]
        tokens = model == "gpt2_lora"
        columns = size.tokens * (VOCABULARY - 1) if tokens else classes - 1
        _steps_seconds(net, batches[:1], meter)  # warm-up (kernels for this head)
        steps = _steps_seconds(net, batches, meter)
        sampled = _pass_seconds(net, batches, 1, meter)
        exact = math.nan if tokens else _pass_seconds(net, batches, 0, meter)
        rows.append({"classes": VOCABULARY if tokens else classes, "columns": columns, "batches": k,
                     "steps_seconds": steps, "exact_seconds": exact, "sampled_seconds": sampled,
                     "exact_steps": exact / steps, "sampled_steps": sampled / steps})
        del net, batches
    return rows


def learnable(module: MapModule) -> List[str]:
    return [n for n, p in module.net.named_parameters() if p.requires_grad]


def measure(model: str, size: Size, device: torch.device) -> Dict[str, Any]:
    """One model's record: plain and default fits, the whole-run ratio, memory, the estimator, the crossover."""
    from lightning_marglik import MargLikCallback

    meter = Meter(device)
    data, n_data = dataset(model, size)
    batch = batch_size(model, size)
    fit(module_of(model, n_data), data, batch, meter, batches=2)  # warm-up
    plain = fit(module_of(model, n_data), data, batch, meter)
    module = module_of(model, n_data)
    callback = MargLikCallback()
    default = fit(module, data, batch, meter, callback)
    epoch, with_callback = plain["epoch"]["seconds"], default["epoch"]["seconds"]
    estimate = default["estimate"]["seconds"]
    plain_peak = max(row["peak_mib"] for row in plain.values())
    default_peak = max(row["peak_mib"] for row in default.values())
    return {
        "model": model, "n_data": n_data, "batch": batch, "size": asdict(size),
        "parameters": sum(p.numel() for p in module.net.parameters()),
        "learnable": learnable(module), "learnable_count": sum(p.numel() for p in module.prior.params),
        "plain": plain, "default": default,
        "epoch": epoch, "epoch_with_callback": with_callback, "estimate": estimate,
        "estimate_epochs": estimate / epoch, "frequency": FREQUENCY,
        "run_ratio": run_ratio(epoch, with_callback, estimate),
        "plain_peak_mib": plain_peak, "default_peak_mib": default_peak, "memory_ratio": default_peak / plain_peak,
        "estimator": callback.estimator, "estimations": callback.estimations, "marglik": callback.last_marglik,
        "output_layer": callback.output_decision,
        "crossover": crossover(model, size, meter),
    }


def run_ratio(epoch: float, epoch_with_callback: float, estimate: float, frequency: int = FREQUENCY) -> float:
    """A run of ``frequency`` epochs and one estimate with the callback over the same epochs without it."""
    return (frequency * epoch_with_callback + estimate) / (frequency * epoch)


def measure_all(models: Sequence[str], size: Size, device: torch.device,
                save: Optional[Callable[[str, Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """:func:`measure` of each model (``save(model, record)`` after each, so that a run cut short keeps what it
    measured). A model that fails is recorded as ``{"model", "error"}`` and the others still run: a lent device's
    minutes are not spent twice for one missing package."""
    records: Dict[str, Any] = {}
    for model in models:
        try:
            records[model] = measure(model, size, device)
        except Exception as err:  # noqa: BLE001  (recorded, the next model runs)
            records[model] = {"model": model, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
        if save is not None:
            save(model, records[model])
    return records
