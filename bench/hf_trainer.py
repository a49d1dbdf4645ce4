"""The Hugging Face ``transformers.Trainer`` side of ``bench/e2e.py``: one fine-tune in this
process, described by a JSON spec that e2e.py writes, with the result written as JSON.

    python bench/hf_trainer.py SPEC.json

The model is ``AutoModel`` (BERT, no pooler layer) + masked mean pooling + dropout + ``nn.Linear``,
cross-entropy; AdamW with a backbone group and a head group (each split into decayed / not
decayed as flaxheads splits them: no decay for biases and LayerNorm), a linear warmup + decay
schedule, global-norm clipping, ``DataCollatorWithPadding``, evaluation each epoch, and
checkpoints as the spec says. Every setting comes from the spec (which e2e.py resolves with
flaxheads' own code); nothing here imports flaxheads, so this process pays for torch and
transformers only. The test logits go back to e2e.py, which scores them with flaxheads' metrics.
"""

from __future__ import annotations

import json
import sys
import time

T_START = time.perf_counter()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402

T_IMPORTED = time.perf_counter()

#: Parameter-name parts that are never weight-decayed (flaxheads' optim.decay_mask: biases, norms).
NO_DECAY = ("bias", "layernorm", "layer_norm", "norm")


class MeanPoolClassifier(nn.Module):
    """Encoder -> masked mean over tokens -> dropout -> linear: flaxheads' ``--pooler mean --head linear``."""

    def __init__(self, path: str, num_labels: int, dropout: float, init_std: float):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(path, add_pooling_layer=False)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.backbone.config.hidden_size, num_labels)
        # flaxheads' LinearHead init: normal(init_std) kernel, zero bias
        nn.init.normal_(self.classifier.weight, std=init_std)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # pooling, head and loss in float32 under bf16 autocast too, as flaxheads keeps them
        with torch.autocast("cpu", enabled=False):
            mask = attention_mask.unsqueeze(-1).float()
            pooled = (hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            logits = self.classifier(self.dropout(pooled))
            loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def param_groups(model: MeanPoolClassifier, optim: dict) -> list[dict]:
    """Four AdamW groups: backbone / head learning rate x decayed / not decayed."""
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        part = "head" if name.startswith("classifier.") else "backbone"
        decays = not any(k in name.lower() for k in NO_DECAY)
        groups.setdefault((part, decays), []).append(p)
    lr = {"backbone": optim["learning_rate"], "head": optim["head_learning_rate"] or optim["learning_rate"]}
    return [
        {"params": ps, "lr": lr[part], "weight_decay": optim["weight_decay"] if decays else 0.0}
        for (part, decays), ps in groups.items()
    ]


class StepClock(TrainerCallback):
    """Seconds between consecutive optimizer steps; an interval that also held an evaluation or
    a checkpoint save is marked, so the throughput can leave it out."""

    def __init__(self):
        self.intervals: list[dict] = []
        self.last = 0.0
        self.busy = False

    def on_train_begin(self, args, state, control, **kw):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.intervals.append(
            {
                "first_step": state.global_step,
                "last_step": state.global_step,
                "seconds": now - self.last,
                "eval": self.busy,
            }
        )
        self.last, self.busy = now, False

    def on_evaluate(self, args, state, control, **kw):
        self.busy = True

    def on_save(self, args, state, control, **kw):
        self.busy = True


class CountingTrainer(Trainer):
    """``Trainer`` that records the number of examples of each training batch."""

    rows: list[int]

    def training_step(self, model, inputs, *args, **kwargs):
        self.rows.append(int(inputs["labels"].shape[0]))
        return super().training_step(model, inputs, *args, **kwargs)


def encode(tok, split: dict, max_length: int) -> list[dict]:
    """Token ids (truncated, unpadded: the collator pads each batch) and the label of each example."""
    enc = tok(split["texts"], truncation=True, max_length=max_length, return_token_type_ids=False)
    return [
        {"input_ids": ids, "attention_mask": m, "labels": int(y)}
        for ids, m, y in zip(enc["input_ids"], enc["attention_mask"], split["labels"])
    ]


def accuracy(pred) -> dict:
    """Validation accuracy (the metric flaxheads keeps the best checkpoint by)."""
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}


def training_args(spec: dict) -> TrainingArguments:
    """The Trainer's settings for the spec (flaxheads' recipe; see e2e.py)."""
    ck = spec["checkpoints"]
    save = (
        {
            "save_strategy": "epoch",
            "save_total_limit": ck["keep"],
            "metric_for_best_model": "accuracy",
            "greater_is_better": True,
        }
        if ck["save"]
        else {"save_strategy": "no"}
    )
    return TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["batch_size"],
        per_device_eval_batch_size=spec["eval_batch_size"],
        num_train_epochs=spec["epochs"],
        max_grad_norm=spec["optim"]["max_grad_norm"] or 0.0,
        eval_strategy="epoch",
        logging_strategy="steps",
        logging_steps=spec["log_every"],
        seed=spec["seed"],
        data_seed=spec["seed"],
        bf16=spec["precision"] == "bfloat16",
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if spec["group_by_length"] else "random",
        load_best_model_at_end=False,
        **save,
    )


def run(spec: dict) -> dict:
    """Tokenise, build, train, evaluate each epoch, predict the test split; the result dict."""
    times = {"imports": T_IMPORTED - T_START}
    t = time.perf_counter()
    with open(spec["data_file"]) as f:
        data = json.load(f)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    sets = {
        name: encode(tok, data[name], spec["max_length"]) for name in ("train", "validation", "test") if name in data
    }
    times["data_and_tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    transformers.set_seed(spec["seed"])
    model = MeanPoolClassifier(spec["model"], spec["num_labels"], spec["dropout"], spec["init_std"])
    optim = spec["optim"]
    opt = torch.optim.AdamW(param_groups(model, optim), betas=(optim["b1"], optim["b2"]), eps=optim["eps"])
    sched = get_linear_schedule_with_warmup(opt, optim["warmup_steps"], optim["total_steps"])
    clock = StepClock()
    trainer = CountingTrainer(
        model=model,
        args=training_args(spec),
        train_dataset=sets["train"],
        eval_dataset=sets.get("validation"),
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
        optimizers=(opt, sched),
        callbacks=[clock],
    )
    trainer.rows = []
    times["model_load"] = time.perf_counter() - t

    out = trainer.train()
    if trainer.state.global_step != optim["total_steps"]:  # the schedule was built for flaxheads' step count
        raise SystemExit(f"hf_trainer: {trainer.state.global_step} steps, the schedule has {optim['total_steps']}")
    for iv, n in zip(clock.intervals, trainer.rows):
        iv["examples"] = n
    evals = [h for h in trainer.state.log_history if "eval_accuracy" in h]
    t = time.perf_counter()
    pred = trainer.predict(sets["test"]) if "test" in sets else None
    times["test_predict"] = time.perf_counter() - t
    return {
        "system": "hf_trainer",
        "precision": spec["precision"],
        "steps": trainer.state.global_step,
        "train_runtime": out.metrics["train_runtime"],
        "n_train": len(sets["train"]),
        "intervals": clock.intervals,
        "validation_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        "test_logits": None if pred is None else np.asarray(pred.predictions, np.float32).tolist(),
        "test_labels": None if pred is None else np.asarray(pred.label_ids).tolist(),
        "timings": times,
        "attn_implementation": model.backbone.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/hf_trainer.py SPEC.json (written by bench/e2e.py)", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
