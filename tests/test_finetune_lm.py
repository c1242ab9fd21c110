"""examples/finetune_lm.py end to end through its CLI, checked against
``transformers``: a tiny random LlamaForCausalLM saved locally (no download),
fine-tuned with LoRA and exported back to a folder ``from_pretrained`` loads."""

import json
import tempfile

import numpy as np
import pytest
import torch

from tests.helpers import load_example
from tests.test_weights import tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    hf = tiny_llama(str(root / "llama"))
    # learnable documents: each walks a fixed cycle through 8 of the 64 tokens
    rng = np.random.default_rng(1)
    cycle = rng.choice(64, 8, replace=False)
    following = {int(cycle[i]): int(cycle[(i + 1) % 8]) for i in range(8)}
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(200):
            token, ids = int(rng.choice(cycle)), []
            for _ in range(int(rng.integers(20, 60))):
                ids.append(token)
                token = following[token]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return hf, root


def run(root, subcommand, *args):
    example = load_example("finetune_lm")
    argv = [
        subcommand,
        "--model.pretrained", str(root / "llama"), "--data.documents", str(root / "docs.jsonl"),
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false",
        "--trainer.default_root_dir", tempfile.mkdtemp(dir=root),
        *args,
    ]  # fmt: skip
    return example.main(argv)


def hf_loss(model, documents):
    """transformers' mean loss over every predicted token of the documents."""
    total = count = 0.0
    with torch.no_grad():
        for doc in documents:
            ids = torch.from_numpy(doc.astype(np.int64))[None]
            total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def exported(folder):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(folder).eval()


def test_the_loss_before_training_is_transformers_loss(setting):
    hf, root = setting
    cli = run(root, "validate")
    rows = cli.datamodule.val_docs
    assert abs(cli.trainer.callback_metrics["val_loss"] - hf_loss(hf, rows)) < 1e-4


def test_a_lora_fine_tune_lowers_transformers_loss_changing_only_the_targets(setting):
    hf, root = setting
    out = root / "lora"
    cli = run(root, "fit", "--model.lora_rank", "8", "--trainer.max_steps", "200",
              "--model.lr", "1e-2", "--model.export", str(out))  # fmt: skip
    rows = cli.datamodule.val_docs
    before, tuned = hf_loss(hf, rows), exported(out)
    assert hf_loss(tuned, rows) <= 0.7 * before
    targets = {"q_proj", "v_proj"}
    original = hf.state_dict()
    for name, value in tuned.state_dict().items():
        if name.split(".")[-2] in targets:
            delta = (value - original[name]).double()
            assert 0 < torch.linalg.matrix_rank(delta, atol=1e-6).item() <= 8, name
        else:
            assert torch.equal(value, original[name]), name


def test_fine_tuning_everything_changes_every_weight(setting):
    hf, root = setting
    out = root / "full"
    run(root, "fit", "--model.lora_rank", "0", "--trainer.max_steps", "20",
        "--model.export", str(out))  # fmt: skip
    original = hf.state_dict()
    for name, value in exported(out).state_dict().items():
        assert not torch.equal(value, original[name]), name


def test_no_steps_export_the_original_bitwise(setting):
    hf, root = setting
    out = root / "none"
    run(root, "fit", "--trainer.max_steps", "0", "--model.export", str(out))
    original = hf.state_dict()
    for name, value in exported(out).state_dict().items():
        assert torch.equal(value, original[name]), name
