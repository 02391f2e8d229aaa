"""A Hugging Face BERT classifier with peft LoRA adapters: the evidence chooses the adapter rank.

1. A tiny ``BertForSequenceClassification`` built from a ``BertConfig`` (no download) is trained
   on the generated token task of ``examples/transformer_tokens.py``: does the bigram "1 2" occur
   in a padded sequence of 6..16 tokens (batches carry an ``attention_mask``)?
2. The shifted task reverses every sequence, so the label asks for "2 1": the same tokens, in the
   other order. The pretrained BERT is frozen and adapted with peft LoRA of rank r on the attention
   query and value (``task_type="SEQ_CLS"``: the classifier head is trained too). Rank 0 trains
   the head alone.
3. Every rank is trained with ``MargLikCallback(structure="kron")`` (Kronecker blocks for the LoRA
   A and B and the head, a layerwise prior over exactly the trainable parameters, learned online)
   and the ranks are compared by the final log evidence per datum.

Usage::

    python examples/hf_sequence_classification.py              # ranks 0, 1, 2, 4, 8: ~1-2 min
    python examples/hf_sequence_classification.py --results    # the same, table to examples/results/
    python examples/hf_sequence_classification.py --quick      # smoke test: seconds

Needs the ``integrations`` extra (``pip install -e ".[integrations]"``: transformers, peft).
"""
from __future__ import annotations

if __name__ == "__main__":
    print("hf_sequence_classification: importing PyTorch, Lightning, transformers and peft ...", flush=True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Dict, List, Optional, Sequence  # noqa: E402

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    OUTPUTS, RESULTS, library_state, markdown_table, quick_or_results, write_report,
)
from transformer_tokens import MAX_LEN, VOCAB, DictDataset, make_sequences  # noqa: E402

NAME = "hf_sequence_classification"
RANKS = (0, 1, 2, 4, 8)


def bert(seed: int) -> nn.Module:
    """A 2-layer BERT (hidden 32, 2 heads) for 2 classes, randomly initialised from its config."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LEN, type_vocab_size=1, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def reversed_sequences(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Every sequence reversed within its length (padding stays at the end): "1 2" becomes "2 1"."""
    ids = data["input_ids"].clone()
    for i, length in enumerate(data["attention_mask"].sum(1).tolist()):
        ids[i, :length] = ids[i, :length].flip(0)
    return {**data, "input_ids": ids}


class Classifier(pl.LightningModule):
    """A Hugging Face classifier with a Gaussian prior over its trainable parameters, trained with ``map_loss``."""

    def __init__(self, net: nn.Module, n_data: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.net, self.n_data, self.lr = net, n_data, lr
        self.prior = GaussianPrior(net)  # the trainable parameters only: LoRA A, B and the head
        self.likelihood = CategoricalLikelihood()

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # the evidence pass needs the logits
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits

    def marglik_batch(self, batch: Dict[str, Tensor]):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, batch["labels"]

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = self.marglik_batch(batch)
        return map_loss(self(**inputs), labels, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.net.parameters() if p.requires_grad], lr=self.lr)


@torch.no_grad()
def metrics(net: nn.Module, data: Dict[str, Tensor]) -> Dict[str, float]:
    """Accuracy and mean negative log-likelihood of a Hugging Face classifier."""
    net.eval()
    logits = net(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    return {"accuracy": (logits.argmax(1) == data["labels"]).double().mean().item(),
            "nll": F.cross_entropy(logits, data["labels"]).item()}


def pretrain(data: Dict[str, Tensor], seed: int, epochs: int) -> nn.Module:
    """Plain training of the whole BERT on the "1 2" task (Adam, no callback)."""
    model = Classifier(bert(seed), len(data["labels"]))
    optimizer = torch.optim.Adam(model.net.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(data["labels"]), generator=generator).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(data["input_ids"][idx], data["attention_mask"][idx]), data["labels"][idx]).backward()
            optimizer.step()
    return model.net.requires_grad_(False)


def adapted(base: nn.Module, rank: int) -> nn.Module:
    """A copy of the frozen ``base`` with LoRA of ``rank`` on query and value and a trainable head (rank 0: head only)."""
    import copy

    from peft import LoraConfig, get_peft_model

    net = copy.deepcopy(base)
    if rank == 0:
        return net.classifier.requires_grad_(True) and net
    return get_peft_model(net, LoraConfig(task_type="SEQ_CLS", r=rank, lora_alpha=rank, lora_dropout=0.0,
                                          target_modules=["query", "value"]))


def fit_rank(base: nn.Module, rank: int, train: Dict[str, Tensor], test: Dict[str, Tensor], epochs: int,
             seed: int) -> Dict:
    start = time.perf_counter()
    pl.seed_everything(seed, verbose=False)
    model = Classifier(adapted(base, rank), len(train["labels"]))
    callback = MargLikCallback(structure="kron", frequency=5, steps=100)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    loader = DataLoader(DictDataset(train), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
    trainer.fit(model, loader)
    return {"rank": rank, "params": model.prior.n_params, "marglik": callback.last_marglik,
            **metrics(model.net, test), "train accuracy": metrics(model.net, train)["accuracy"],
            "seconds": time.perf_counter() - start}


def run(quick: bool = False, seed: int = 0, ranks: Sequence[int] = RANKS) -> Dict:
    n_train, n_test, pre_epochs, epochs = (128, 128, 5, 5) if quick else (1024, 512, 30, 30)
    task_a = make_sequences(n_train, seed)
    base = pretrain(task_a, seed, pre_epochs)
    train = reversed_sequences(make_sequences(n_train, seed + 1))
    test = reversed_sequences(make_sequences(n_test, seed + 2))
    rows: List[Dict] = [fit_rank(base, r, train, test, epochs, seed) for r in ranks]
    return {"rows": rows, "seed": seed, "n_train": n_train, "n_test": n_test, "epochs": epochs,
            "pre_epochs": pre_epochs, "base_accuracy": metrics(base, task_a)["accuracy"],
            "base_on_shift": metrics(base, test)["accuracy"],
            "chosen": max(rows, key=lambda r: r["marglik"])["rank"],
            "best_accuracy": max(rows, key=lambda r: (r["accuracy"], -r["nll"]))["rank"]}


def markdown(out: Dict, command: str, seconds: float) -> str:
    rows = [{"rank": f"{r['rank']}" + (" **(chosen)**" if r["rank"] == out["chosen"] else ""),
             "trainable params": r["params"], "marglik/N": r["marglik"], "test acc": r["accuracy"],
             "test NLL": r["nll"], "train acc": r["train accuracy"], "wall s": round(r["seconds"], 1)}
            for r in out["rows"]]
    by_rank = {r["rank"]: r for r in out["rows"]}
    chosen, best = by_rank[out["chosen"]], by_rank[out["best_accuracy"]]
    return "\n".join([
        "# A Hugging Face BERT with peft LoRA: the evidence chooses the adapter rank", "",
        f"Date: {datetime.date.today()}. Library: {library_state()}. Command: `{command}`. Total wall time "
        f"{seconds:.0f} s (2 shared CPU cores, 1 thread). Seed {out['seed']}.", "",
        f"Base: `BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, "
        f"intermediate_size=64, vocab_size={VOCAB}, max_position_embeddings={MAX_LEN}))`, randomly initialised, "
        f"trained on the \"1 2\" bigram task ({out['n_train']} padded sequences, Adam lr 3e-3, {out['pre_epochs']} "
        f"epochs; training accuracy {out['base_accuracy']:.3f}), then frozen. Shifted task: the sequences reversed "
        f"(\"2 1\"), {out['n_train']} train / {out['n_test']} test; the frozen base scores {out['base_on_shift']:.3f} "
        "on its test set. Adapters: peft `LoraConfig(task_type='SEQ_CLS', r=rank, lora_alpha=rank, "
        "target_modules=['query', 'value'])` plus the trained head; rank 0 is the head alone. Recipe (every rank): "
        f"Adam lr 3e-3, batch 64, {out['epochs']} epochs, `MargLikCallback(structure='kron', frequency=5, "
        "steps=100)` (a layerwise prior over exactly the trainable parameters, learned online); marglik/N is the "
        "last estimate.", "",
        markdown_table(rows, list(rows[0])), "",
        f"The evidence picks rank **{chosen['rank']}** (test accuracy {chosen['accuracy']:.3f}, NLL "
        f"{chosen['nll']:.3f}); the best test accuracy is at rank {best['rank']} ({best['accuracy']:.3f}, NLL "
        f"{best['nll']:.3f}).", "",
    ])


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    options = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    quick_or_results(options, "smoke test: 128 sequences, 5 epochs, ranks 0 and 2",
                     "write the table to examples/results/")
    options.add_argument("--output-dir", help="where the table goes (default: outputs/, ignored by git)")
    options.add_argument("--threads", type=int, default=1)
    options.add_argument("--seed", type=int, default=0)
    args = options.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with quiet_lightning():  # no per-Trainer banners
        out = run(args.quick, args.seed, (0, 2) if args.quick else RANKS)
    seconds = time.perf_counter() - start
    for r in out["rows"]:
        print(f"rank {r['rank']}  params {r['params']}  marglik {r['marglik']:.4f}  test acc {r['accuracy']:.4f}  "
              f"NLL {r['nll']:.4f}  {r['seconds']:.1f}s")
    print(f"the evidence picks rank {out['chosen']}; best test accuracy at rank {out['best_accuracy']}")
    target = args.output_dir or (RESULTS if args.results else OUTPUTS)
    write_report(NAME, argv, target, lambda command: markdown(out, command, seconds))
    print(f"total {seconds:.0f}s, wrote {target}/{NAME}.md")
    return out


if __name__ == "__main__":
    main()
