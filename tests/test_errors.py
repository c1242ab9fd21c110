"""Bad input gets an error that names the problem, raised before JAX sees it."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer


class NoLoss(jl.JaxModule):
    def setup(self, rng, batch):
        return {"params": {}}

    def configure_optimizers(self):
        import optax

        return optax.sgd(0.1)


class DictData(Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.item(i)


def test_module_without_loss_is_named():
    with pytest.raises(NotImplementedError, match=r"NoLoss does not define loss\(\)"):
        quiet_trainer(max_steps=1).fit(NoLoss(), loader(*digits(16), 8))


@pytest.mark.parametrize(("call", "step"), [("test", "test_step"), ("validate", "validation_step")])
def test_an_evaluation_without_its_step_names_it_as_lightning(call, step):
    # Lightning: "No `test_step()` method defined to run `Trainer.test`." (a
    # module with only validation_step was told eval_step was missing; issue 61)
    class OnlyOther(LitMLP):
        eval_step = jl.JaxModule.eval_step

    if call == "test":
        OnlyOther.validation_step = LitMLP.eval_step
    else:
        OnlyOther.test_step = LitMLP.eval_step
    with pytest.raises(NotImplementedError, match=rf"No `{step}\(\)` method defined"):
        getattr(quiet_trainer(), call)(OnlyOther(), loader(*digits(16), 8))


def test_an_integer_parameter_is_named_before_jax_differentiates_it():
    # JAX's grad error named no leaf (issue 61)
    import jax.numpy as jnp

    class IntLeaf(LitMLP):
        def setup(self, rng, batch):
            params = super().setup(rng, batch)["params"]
            return {"params": {**params, "counter": jnp.zeros((), jnp.int32)}}

    with pytest.raises(TypeError, match=r"variables\['params'\]\['counter'\] of dtype int32"):
        quiet_trainer(max_steps=1).fit(IntLeaf(), loader(*digits(16), 8))


def test_module_without_super_init_is_named():
    class Forgetful(LitMLP):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match=r"Forgetful.__init__ must call super\(\).__init__\(\)"):
        quiet_trainer(max_steps=1).fit(Forgetful(), loader(*digits(16), 8))


def test_mismatched_leading_dimensions_name_keys_and_sizes():
    bad = [{"x": torch.zeros(8, 64), "y": torch.zeros(5, dtype=torch.long)}]
    with pytest.raises(jl.BatchError, match=r"batch\['y'\] has 5 rows but batch\['x'\] has 8"):
        quiet_trainer(max_steps=1).fit(LitMLP(), bad)


def test_string_fields_are_named():
    data = DictData(lambda i: {"x": np.zeros(64, np.float32), "name": f"img{i}.png"})
    with pytest.raises(jl.BatchError, match=r"batch\['name'\]\[0\] holds str data"):
        quiet_trainer(max_steps=1).fit(LitMLP(), DataLoader(data, batch_size=8))


def test_object_arrays_are_named():
    bad = [(np.zeros((8, 64), np.float32), np.array([None] * 8, dtype=object))]
    with pytest.raises(jl.BatchError, match=r"batch\[1\] holds object data"):
        quiet_trainer(max_steps=1).fit(LitMLP(), bad)


def test_empty_dataloader_is_named():
    empty = DataLoader(TensorDataset(torch.zeros(0, 64), torch.zeros(0)), batch_size=8)
    with pytest.raises(ValueError, match="train_dataloaders yielded no batches"):
        quiet_trainer(max_steps=1).fit(LitMLP(), empty)


def test_loss_of_wrong_shape_is_named():
    class WrongShape(LitMLP):
        def loss(self, variables, batch, rngs):
            return self.net.apply(variables, batch[0])  # logits, not a loss

    with pytest.raises(ValueError, match=r"loss\(\) returned shape \(8, 10\); return a scalar"):
        quiet_trainer(max_steps=1).fit(WrongShape(), loader(*digits(64), 64))


def test_log_of_wrong_shape_is_named():
    class WrongLog(LitMLP):
        def loss(self, variables, batch, rngs):
            self.log("logits", self.net.apply(variables, batch[0]))
            return jnp.zeros(batch[0].shape[0])

    with pytest.raises(ValueError, match=r"self.log\('logits', ...\) got an array of shape"):
        quiet_trainer(max_steps=1).fit(WrongLog(), loader(*digits(64), 64))


def test_log_outside_traced_hook_is_explained():
    # Lightning warns ("not registered on the model yet") and logs nothing
    with pytest.warns(UserWarning, match="not attached to a Trainer"):
        LitMLP().log("acc", 1.0)


def test_too_many_devices_says_how_to_simulate():
    with pytest.raises(ValueError, match="devices=9 but this process has 8 local cpu"):
        jl.Trainer(devices=9)


def test_unknown_strategy_lists_choices():
    with pytest.raises(ValueError, match=r"strategy='ddp' is not known; use one of"):
        jl.Trainer(strategy="ddp")


def test_optimizer_that_is_not_optax_is_named():
    class TorchOpt(LitMLP):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.zeros(1)], lr=0.1)

    with pytest.raises(TypeError, match="configure_optimizers\\(\\) returned SGD"):
        quiet_trainer(max_steps=1).fit(TorchOpt(), loader(*digits(16), 8))


def test_failing_dataset_error_reaches_the_caller():
    def boom(i):
        if i == 12:
            raise KeyError("sample 12 is corrupt")
        return np.zeros(64, np.float32), 0

    with pytest.raises(KeyError, match="sample 12 is corrupt"):
        quiet_trainer(max_epochs=1).fit(LitMLP(), DataLoader(DictData(boom), batch_size=8))
