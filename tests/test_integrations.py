"""The packages people use (issue 18.5): Hugging Face transformers, peft, timm, built from configs.

Every model is tiny and built from a config (no download). For each: the float64 diagonal and full
(and, for the timm ResNet and MLP-Mixer, Kronecker) log-determinants equal the dense reference
(tests/reference.py: Jacobians of the whole batch by ``jacrev``), and ``structure="kron"`` runs in a real
``Trainer`` with the callback, with only the modules that need it on the exact per-example path. Each test is
skipped, with the reason, when its package is absent (``pip install -e ".[integrations]"``).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, map_loss
from tests.lightning_models import trainer
from tests.real_networks import _perturb_affine
from tests.reference import graph_problem, rel_err, reference_env  # noqa: F401 (reference_env: autouse fixture)

TOL = 1e-8
IGNORE = -100
N, BATCH, SEQ, VOCAB, CLASSES = 8, 4, 5, 12, 3


class Logits(nn.Module):
    """A Hugging Face model whose forward returns the logits tensor (the evidence pass needs a tensor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Tensor) -> Tensor:
        return self.model(**inputs).logits


def tokens(n: int = N, seed: int = 0) -> Dict[str, Tensor]:
    """Token ids with an attention mask; every other example padded after 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[::2, 3:] = 0
    return {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g) * mask, "attention_mask": mask}


def next_token_labels(inputs: Dict[str, Tensor]) -> Tensor:
    """Next-token targets, ``IGNORE`` at the last position and wherever the next token is padding."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], IGNORE)
    return labels


def classes(n: int = N, seed: int = 1) -> Tensor:
    return torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(seed))


def batches(inputs, y: Tensor, size: int = BATCH) -> List[Tuple[object, Tensor]]:
    if isinstance(inputs, dict):
        return [({k: v[i : i + size] for k, v in inputs.items()}, y[i : i + size]) for i in range(0, len(y), size)]
    return [(inputs[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def check_log_det(model: nn.Module, inputs, y: Tensor, structure: str) -> None:
    """The library's log-determinant, log evidence and n_data equal the dense reference's."""
    problem = graph_problem(model, inputs, y, "classification", IGNORE)
    prior = GaussianPrior(model)
    with torch.no_grad():  # distinct precisions per group, so that a mixed-up group mapping shows
        prior.log_precision.copy_(torch.linspace(-1.0, 1.0, prior.log_precision.numel()))
    likelihood = CategoricalLikelihood(temperature=0.8, ignore_index=IGNORE)
    assert prior.param_names == problem.names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exact-path notes: which path is taken is checked in the Trainer tests
        ev = LaplaceEvidence.fit(model, batches(inputs, y), likelihood, prior, structure=structure,
                                 mc_samples=0)  # the exact GGN the reference computes ("auto" samples for a vocabulary)
    expected = problem.reference(structure, "ggn").evaluate(prior, likelihood)
    assert ev.n_data == problem.n_data
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL, (float(ev.log_det()), float(expected["log_det"]))
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL


class Module(pl.LightningModule):
    """Any network in a LightningModule trained with the MAP loss; batches are ``(inputs, targets)``."""

    def __init__(self, net: nn.Module, n_data: int) -> None:
        super().__init__()
        self.net, self.n_data = net, n_data
        self.prior = GaussianPrior(net)
        self.likelihood = CategoricalLikelihood(ignore_index=IGNORE)

    def forward(self, *args, **kwargs) -> Tensor:
        return self.net(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        inputs, y = batch
        output = self(**inputs) if isinstance(inputs, dict) else self(inputs)
        return map_loss(output, y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.net.parameters() if p.requires_grad], lr=1e-2)


def fit_kron(net: nn.Module, inputs, y: Tensor) -> Tuple[MargLikCallback, Module, str]:
    """Two epochs with the kron callback; returns it, the module and the exact-path warnings' text."""
    module = Module(net, int((y != IGNORE).sum()))
    start = module.prior.log_precision.detach().clone()
    callback = MargLikCallback(structure="kron", steps=5, settle=None, frequency=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_epochs=2).fit(module, DataLoader(batches(inputs, y), batch_size=None))
    assert len(callback.history) == 2
    assert all(torch.isfinite(torch.tensor(h["marglik"])) for h in callback.history), callback.history
    learned = module.prior.log_precision.detach()
    assert torch.isfinite(learned).all() and not torch.equal(learned, start)
    return callback, module, " ".join(str(w.message) for w in caught if "exact per-example" in str(w.message))


# --- Hugging Face transformers: Qwen3's query and key norms ------------------------------------------


def test_qwen3_query_and_key_projections_are_found_scale_invariant_through_its_own_rmsnorm():
    """Qwen3's q_proj and k_proj feed only q_norm / k_norm, instances of its own ``Qwen3RMSNorm`` (no torch norm
    class): the training loss does not change with their scale, and the analysis finds them, nothing else."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    if not hasattr(transformers, "Qwen3Config"):
        pytest.skip("this transformers has no Qwen3")
    from lightning_marglik.curvature.scale_invariance import find_scale_invariant

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16, pad_token_id=0, num_labels=CLASSES)
    net = Logits(transformers.Qwen3ForSequenceClassification(config))
    found = {layer.layer: layer.norm for layer in find_scale_invariant(net, tokens())}
    attention = "model.model.layers.0.self_attn"
    assert found == {f"{attention}.q_proj": f"{attention}.q_norm", f"{attention}.k_proj": f"{attention}.k_norm"}


# --- Hugging Face transformers: BERT with an attention mask ----------------------------------------


def bert(hidden: int = 8, seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, intermediate_size=hidden,
        max_position_embeddings=SEQ, type_vocab_size=1, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return Logits(transformers.BertForSequenceClassification(config)).eval()


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_bert_with_attention_mask_matches_reference(structure):
    """full: every parameter on the exact path, where HF's mask helpers make vmap fall back to autograd."""
    check_log_det(bert(), tokens(), classes(), structure)


def test_bert_classifier_kron_in_trainer():
    """The position embedding (arange(T) shared by the batch) takes the layer hooks, not the exact path."""
    _, _, exact = fit_kron(bert(hidden=16), tokens(), classes())
    assert exact == "", exact  # no module on the exact path


# --- GPT-2 LM: padding (ignored targets) and tied input/output embeddings --------------------------


def gpt2(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=8, n_layer=1, n_head=2, n_inner=8, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )
    net = Logits(transformers.GPT2LMHeadModel(config)).eval()
    assert net.model.lm_head.weight is net.model.transformer.wte.weight
    return net


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_gpt2_lm_with_padding_and_tied_embeddings_matches_reference(structure):
    inputs = tokens(6)
    labels = next_token_labels(inputs)
    assert (labels == IGNORE).sum() > 6  # padded and last positions count nowhere
    check_log_det(gpt2(), inputs, labels, structure)


def test_gpt2_lm_kron_in_trainer():
    """HF's Conv1D block layers and the position embedding take the layer hooks; only the tied wte is exact."""
    inputs = tokens()
    _, _, exact = fit_kron(gpt2(), inputs, next_token_labels(inputs))
    assert "'net.model.transformer.wte'" in exact, exact
    for name in ("c_attn", "c_fc", "c_proj", "wpe"):
        assert name not in exact, exact


# --- peft LoRA -----------------------------------------------------------------------------------


def lora(seed: int = 0) -> nn.Module:
    peft = pytest.importorskip("peft", reason="peft is not installed")
    net = bert(seed=seed)
    net.model = peft.get_peft_model(
        net.model, peft.LoraConfig(r=2, lora_alpha=2, target_modules=["query", "value"], lora_dropout=0.0)
    )
    with torch.no_grad():  # peft starts B at zero, where A has no curvature at all
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return net.eval()


def test_lora_prior_covers_exactly_the_trainable_parameters():
    net = lora()
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert GaussianPrior(net).param_names == trainable


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_lora_adapter_matches_reference(structure):
    check_log_det(lora(), tokens(), classes(), structure)


def test_lora_kron_in_trainer():
    _, module, exact = fit_kron(lora(), tokens(), classes())
    assert module.prior.param_names == [n for n, p in module.net.named_parameters() if p.requires_grad]
    assert exact == "", exact  # the LoRA A and B are Linear layers on the hooks


# --- timm: a small ResNet (BatchNorm, in-place ReLU, residual +=), a small ViT and an MLP-Mixer ------


def resnet(seed: int = 0) -> nn.Module:
    pytest.importorskip("timm", reason="timm is not installed")
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(seed)
    net = ResNet(
        BasicBlock, [1, 1, 1, 1], num_classes=CLASSES, in_chans=1, stem_type="deep", stem_width=2,
        channels=(2, 2, 2, 2), zero_init_last=False,
    )
    _perturb_affine(*[m for m in net.modules() if isinstance(m, nn.BatchNorm2d)])
    return net.eval()


def vit(seed: int = 0) -> nn.Module:
    pytest.importorskip("timm", reason="timm is not installed")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    return VisionTransformer(
        img_size=8, patch_size=4, in_chans=1, num_classes=CLASSES, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2.0
    ).eval()


def mixer(seed: int = 0, zero_head: bool = False) -> nn.Module:
    """A small MLP-Mixer (token- and channel-mixing Mlps over transposed tokens, LayerNorms). timm initializes
    its head to zero, which makes every other layer's Jacobian, and so its curvature, exactly zero: the head is
    drawn at random unless ``zero_head``."""
    pytest.importorskip("timm", reason="timm is not installed")
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(seed)
    net = MlpMixer(num_classes=CLASSES, img_size=8, in_chans=1, patch_size=4, num_blocks=1, embed_dim=4,
                   mlp_ratio=(0.5, 1.0))
    _perturb_affine(*[m for m in net.modules() if isinstance(m, nn.LayerNorm)])
    if not zero_head:
        with torch.no_grad():
            net.head.weight.normal_()
    return net.eval()


def images(size: int = 8, n: int = N) -> Tensor:
    return torch.randn(n, 1, size, size, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_timm_resnet_matches_reference(structure):
    check_log_det(resnet(), images(16), classes(), structure)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_timm_vit_matches_reference(structure):
    check_log_det(vit(), images(), classes(), structure)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_timm_mixer_matches_reference(structure):
    check_log_det(mixer(), images(), classes(), structure)


def test_timm_mixer_with_its_zero_head_matches_reference():
    """timm's own init: no row upstream of the zero head carries a loss term, every block but the head's is 0."""
    check_log_det(mixer(zero_head=True), images(), classes(), "kron")


def test_timm_resnet_kron_in_trainer():
    _, _, exact = fit_kron(resnet(), images(16), classes())
    assert exact == "", exact  # every Conv2d, BatchNorm and the Linear head on the layer hooks


def test_timm_vit_kron_in_trainer():
    _, _, exact = fit_kron(vit(), images(), classes())
    assert "qkv" not in exact and "patch_embed" not in exact, exact
