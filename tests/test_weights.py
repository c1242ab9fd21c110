"""Published weights in and out (`jl.load_weights`, `jl.save_weights`): checked
against the ``safetensors`` library, ``transformers``' own Llama and PyTorch."""

import fractions
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlightning as jl
from jaxlightning.io import safetensors_format
from jaxlightning.io.weight_sources import open_source
from tests.helpers import CountingSource, load_example

RNG = np.random.default_rng(0)


def tiny_llama(folder, *, shard_size="20KB", tie=False, seed=0):
    """A random LlamaForCausalLM, written as save_pretrained writes it."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size=shard_size)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    return tiny_llama(folder), folder


def abstract_llama(example, folder):
    module = example.FineTuneLM(folder, lora_rank=0)
    tokens = jnp.zeros((1, 16), jnp.int32)
    return module, jax.eval_shape(module.net.init, jax.random.key(0), tokens)


# ----------------------------------------------------------- the file format
def test_safetensors_written_here_read_by_the_library_and_back_bitwise(tmp_path):
    arrays = {
        "a.weight": RNG.normal(size=(3, 5)).astype(np.float32),
        "b": RNG.integers(-9, 9, (7,)).astype(np.int64),
        "c": RNG.normal(size=(2, 2)).astype(ml_dtypes.bfloat16),
    }
    path = tmp_path / "x.safetensors"
    safetensors_format.write(path, arrays)
    by_torch = safetensors.torch.load_file(path)
    np.testing.assert_array_equal(by_torch["a.weight"].numpy(), arrays["a.weight"])
    np.testing.assert_array_equal(by_torch["b"].numpy(), arrays["b"])
    bf16 = by_torch["c"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16, arrays["c"])
    ours = safetensors_format.SafetensorsFile(path)
    assert ours.names()["c"] == ((2, 2), np.dtype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(
        ours.read("a.weight", (slice(1, 3), slice(None))), arrays["a.weight"][1:3]
    )


def test_safetensors_written_by_the_library_read_here(tmp_path):
    arrays = {"w": RNG.normal(size=(4, 6)).astype(np.float16)}
    safetensors.numpy.save_file(arrays, tmp_path / "lib.safetensors")
    loaded = jl.load_weights(tmp_path / "lib.safetensors", {"w": np.zeros((4, 6), np.float16)})
    np.testing.assert_array_equal(loaded["w"], arrays["w"])


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="bad.safetensors is not a safetensors file"):
        jl.load_weights(path, {"w": np.zeros(2)})


# ---------------------------------------------- transformers' Llama, both ways
def test_a_sharded_llama_folder_loads_into_the_flax_llama_and_computes_its_logits(llama):
    hf, folder = llama
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    example = load_example("finetune_lm")
    module, abstract = abstract_llama(example, folder)
    variables = jl.load_weights(folder, abstract, rename=example.HF_LLAMA)
    tokens = RNG.integers(0, 64, (3, 16))
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(module.net.apply(variables, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_saved_weights_load_back_into_transformers_bitwise(llama, tmp_path):
    import transformers

    hf, folder = llama
    example = load_example("finetune_lm")
    _, abstract = abstract_llama(example, folder)
    variables = jl.load_weights(folder, abstract, rename=example.HF_LLAMA)
    files = jl.save_weights(variables, tmp_path, rename=example.HF_LLAMA, max_shard_size=8000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    shutil.copy(os.path.join(folder, "config.json"), tmp_path)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


# ----------------------------------------------------------------- mismatches
def test_strict_loading_names_every_missing_unexpected_and_mismatched_name(llama):
    _, folder = llama
    example = load_example("finetune_lm")
    _, abstract = abstract_llama(example, folder)
    rules = [r for r in example.HF_LLAMA if not r[0].startswith("model.norm")]
    rules.append(
        ("model.layers.{i}.mlp.down_proj.weight", "params/layers_{i}/mlp/down_proj/kernel")
    )
    rules = [rules[-1], *rules[:-1]]  # down_proj without the transpose, first
    with pytest.raises(jl.WeightsMismatchError) as caught:
        jl.load_weights(folder, abstract, rename=rules)
    report = caught.value.report
    assert report.missing == [
        "params/layers_0/mlp/down_proj/kernel",
        "params/layers_1/mlp/down_proj/kernel",
        "params/norm/weight",
    ]
    assert report.unexpected == ["model.norm.weight"]
    assert {m[0] for m in report.mismatched} == {
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    }
    assert "(32, 48), the tree's part needs (48, 32)" in report.mismatched[0][2]
    message = str(caught.value)
    assert "params/norm/weight (closest: model.norm.weight)" in message
    assert "3 missing" in message and "rename=" in message


def test_non_strict_loading_fills_what_fits_keeps_the_rest_and_warns(tmp_path):
    safetensors_format.write(
        tmp_path / "w.safetensors",
        {"a": np.ones((2,), np.float32), "zzz": np.ones((3,), np.float32)},
    )
    into = {"a": np.zeros((2,), np.float32), "b": np.full((2,), 7.0, np.float32)}
    with pytest.warns(UserWarning, match="1 missing"):
        out = jl.load_weights(tmp_path / "w.safetensors", into, strict=False)
    np.testing.assert_array_equal(out["a"], 1.0)
    np.testing.assert_array_equal(out["b"], 7.0)
    report = jl.check_weights(tmp_path / "w.safetensors", into)
    assert report.loaded == ["a"] and report.missing == ["b"] and report.unexpected == ["zzz"]


def test_an_abstract_leaf_with_no_source_is_an_error_even_when_not_strict(tmp_path):
    safetensors_format.write(tmp_path / "w.safetensors", {"a": np.ones((2,), np.float32)})
    into = {
        "a": jax.ShapeDtypeStruct((2,), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    with pytest.raises(jl.WeightsMismatchError, match="b"):
        jl.load_weights(tmp_path / "w.safetensors", into, strict=False)


def test_an_integer_source_does_not_silently_become_a_float_parameter(tmp_path):
    safetensors_format.write(tmp_path / "w.safetensors", {"a": np.ones((2,), np.int32)})
    with pytest.raises(jl.WeightsMismatchError, match="dtype int32 cannot become"):
        jl.load_weights(tmp_path / "w.safetensors", {"a": np.zeros((2,), np.float32)})


# --------------------------------------------------- layouts: stacked, fused
def test_stacked_and_fused_layouts_load_and_save_back_to_the_same_names(tmp_path):
    names = {}
    for i in range(3):
        names[f"h.{i}.w"] = RNG.normal(size=(4, 2)).astype(np.float32)  # (out, in)
        for part in ("q", "k"):
            names[f"h.{i}.{part}"] = RNG.normal(size=(5,)).astype(np.float32)
    rules = [
        ("h.{i}.w", "params/blocks/w[{i}]", "T"),  # stacked over a leading layer axis
        ("h.{i}.q", "params/qk_{i}[0:5]"),  # fused: q then k in one vector
        ("h.{i}.k", "params/qk_{i}[5:10]"),
    ]
    into = {
        "params": {
            "blocks": {"w": np.zeros((3, 2, 4), np.float32)},
            **{f"qk_{i}": np.zeros((10,), np.float32) for i in range(3)},
        }
    }
    out = jl.load_weights(names, into, rename=rules)
    np.testing.assert_array_equal(out["params"]["blocks"]["w"][1], names["h.1.w"].T)
    np.testing.assert_array_equal(out["params"]["qk_2"][5:], names["h.2.k"])
    jl.save_weights(out, tmp_path / "back.safetensors", rename=rules)
    back = safetensors.numpy.load_file(tmp_path / "back.safetensors")
    assert sorted(back) == sorted(names)
    for name, value in names.items():
        np.testing.assert_array_equal(back[name], value)


def test_pieces_that_do_not_cover_a_leaf_leave_it_missing():
    names = {"q": np.ones((5,), np.float32)}
    report = jl.check_weights(names, {"qk": np.zeros((10,), np.float32)}, rename=[("q", "qk[0:5]")])
    assert report.missing == ["qk"] and not report.unexpected


# --------------------------------------------------------- other sources
def test_a_pytorch_state_dict_and_a_lightning_checkpoint_load(tmp_path):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    net = Net()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), 2)
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(net, data)
    trainer.save_checkpoint(tmp_path / "lit.ckpt")
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    rules = [("layer.weight", "params/Dense_0/kernel", "T"), ("layer.bias", "params/Dense_0/bias")]
    into = {
        "params": {
            "Dense_0": {"kernel": np.zeros((3, 2), np.float32), "bias": np.zeros((2,), np.float32)}
        }
    }
    expected = net.layer.weight.detach().numpy().T
    for source in (tmp_path / "sd.pt", tmp_path / "lit.ckpt"):
        out = jl.load_weights(source, into, rename=rules)
        np.testing.assert_array_equal(out["params"]["Dense_0"]["kernel"], expected)
    out = jl.load_weights(net.state_dict(), into, rename=rules)  # a mapping, in memory
    np.testing.assert_array_equal(out["params"]["Dense_0"]["bias"], net.layer.bias.detach())


def test_a_pickled_object_in_a_torch_file_is_refused_unless_trusted(tmp_path):
    torch.save({"w": torch.ones(2), "obj": fractions.Fraction(1, 3)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        jl.load_weights(tmp_path / "x.pt", {"w": np.zeros(2, np.float32)})
    with pytest.raises(TypeError, match="'obj' is a Fraction, not an array"):
        jl.load_weights(tmp_path / "x.pt", {"w": np.zeros(2, np.float32)}, allow_pickle=True)


def test_bfloat16_torch_weights_are_cast_to_the_tree_dtype_and_reported():
    weight = torch.randn(4, dtype=torch.bfloat16)
    into = {"w": np.zeros((4,), np.float32)}
    assert jl.check_weights({"w": weight}, into).cast == [("w", "bfloat16", "float32")]
    out = jl.load_weights({"w": weight}, into)
    np.testing.assert_array_equal(out["w"], weight.float().numpy())


# ------------------------------------------------------------ sharded loading
def test_a_sharded_tree_is_built_shard_by_shard_never_reading_a_whole_array(tmp_path):
    weight = RNG.normal(size=(64, 16)).astype(np.float32)  # a Linear (out, in)
    safetensors_format.write(tmp_path / "w.safetensors", {"w": weight})
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P(None, "data"))  # the kernel (16, 64) split on its columns
    into = {"kernel": jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=sharding)}
    source = CountingSource(open_source(tmp_path / "w.safetensors"))
    out = jl.load_weights(source, into, rename=[("w", "kernel", "T")])
    assert out["kernel"].sharding == sharding
    shard = 16 * 64 // len(jax.devices())
    assert source.reads and max(source.reads) == shard
    for piece in out["kernel"].addressable_shards:
        assert piece.data.shape == (16, 64 // len(jax.devices()))
    np.testing.assert_array_equal(np.asarray(out["kernel"]), weight.T)


def test_a_checkpoint_of_this_project_is_a_source(tmp_path):
    from jaxlightning.io.checkpoint import save_at

    params = {"Dense_0": {"kernel": RNG.normal(size=(3, 2)).astype(np.float32)}}
    state = {"step": np.int32(0), "params": params, "model_state": {}}
    save_at(str(tmp_path / "ckpt"), 0, {"state": state, "acc": {}}, {"step": 0})
    out = jl.load_weights(
        tmp_path / "ckpt", {"params": {"Dense_0": {"kernel": np.zeros((3, 2), np.float32)}}}
    )
    np.testing.assert_array_equal(out["params"]["Dense_0"]["kernel"], params["Dense_0"]["kernel"])


def test_the_index_names_files_the_folder_lacks(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(FileNotFoundError):
        jl.load_weights(tmp_path, {"w": np.zeros(2)})


@pytest.mark.slow
def test_each_process_reads_only_its_devices_blocks_and_saving_gathers_them(tmp_path):
    import subprocess
    import sys

    weight = RNG.normal(size=(64, 16)).astype(np.float32)
    safetensors_format.write(tmp_path / "w.safetensors", {"w": weight})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable, "-m", "jaxlightning.launch", "--nprocs", "2", "--devices-per-proc", "4",
        os.path.join(root, "tests", "run_weights.py"),
        "--file", str(tmp_path / "w.safetensors"), "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": ""}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["local_devices"] == 4 and record["shards_match"]
        assert sum(record["reads"]) == weight.size // 2  # its half, not a byte more
        assert max(record["reads"]) == weight.size // 8  # one device's block at a time
    back = safetensors.numpy.load_file(tmp_path / "back.safetensors")
    np.testing.assert_array_equal(back["w"], weight)
