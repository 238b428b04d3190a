"""Model families are registered bundles (models/family.py): a third family, written here as a
plain Flax user would (nnx.Embed, nnx.Linear, an optax loss, logical names on the weights) and
registered in one call, trains through the main job under a layout and equals the main job on one
device; what it lacks (a decoder, jaxpar's attention op for context parallelism, another family's
options) is refused in words."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import models
from jaxpar.errors import JaxparError, LayoutError
from jaxpar.models.family import Family
from jaxpar.run import RunConfig, build_trainer, run_model_config, run_training
from jaxpar.serve import common
from jaxpar.topology import load_topology
from jaxpar.train.config import TrainConfig

part, init = nnx.with_partitioning, nnx.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class MixerConfig:
    vocab_size: int = 256
    width: int = 32
    hidden: int = 64

    def num_params(self) -> int:
        return self.vocab_size * self.width + 2 * self.width * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.num_params()


class Mixer(nnx.Module):
    """A token's embedding through one MLP, read out by the tied embedding (no attention)."""

    def __init__(self, cfg: MixerConfig, *, rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, embedding_init=part(init, ("vocab", "embed")), rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.hidden, kernel_init=part(init, ("embed", "mlp")),
                             bias_init=part(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.width, use_bias=False, kernel_init=part(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.embed.attend(x + self.down(nnx.gelu(self.up(x))))


def mixer_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


MIXER = Family(name="mixer", words="token mixer", config_type=MixerConfig, configs={"mixer-tiny": MixerConfig()},
               model=lambda cfg, rngs: Mixer(cfg, rngs=rngs), loss=mixer_loss)


@pytest.fixture
def registered():
    models.register(MIXER)  # the one line a third family adds to jaxpar/models/__init__.py
    yield
    models.unregister("mixer")


def test_a_third_family_trains_through_the_main_job_and_equals_one_device(registered):
    run = RunConfig(model="mixer-tiny", strategy="data=2,fsdp=2,tensor=2", steps=4, batch_size=8, seq_len=16,
                    train=TrainConfig(warmup_steps=0, learning_rate=0.03))
    split = run_training(run, load_topology("cpu-8"))
    alone = run_training(dataclasses.replace(run, strategy="data=1"), load_topology("cpu-1"))
    np.testing.assert_allclose(split["losses"], alone["losses"], rtol=2e-5)
    assert split["path"]["name"] == "gspmd" and split["losses"][-1] < split["losses"][0]


def test_what_a_family_lacks_is_refused_in_words(registered):
    with pytest.raises(JaxparError, match="model mixer-tiny is a token mixer, which jaxpar generate has no decoder for"):
        common.check_decoder("mixer", "mixer-tiny")
    with pytest.raises(JaxparError, match="--block-size 16 is for block diffusion models .*mixer-tiny is a token mixer: drop it"):
        run_model_config(RunConfig(model="mixer-tiny", block_size=16))
    with pytest.raises(JaxparError, match="the block axis is not supported by model mixer-tiny"):
        build_trainer(RunConfig(model="mixer-tiny", strategy="block=2,data=4", seq_len=16), load_topology("cpu-8"))
    with pytest.raises(LayoutError, match="context parallelism"):  # its model never calls jaxpar's attention op: in the plan
        build_trainer(RunConfig(model="mixer-tiny", strategy="context=2,data=4", batch_size=8, seq_len=16), load_topology("cpu-8"))
    unregistered = dataclasses.make_dataclass("WiderConfig", [], bases=(MixerConfig,), frozen=True)
    with pytest.raises(JaxparError, match="WiderConfig is the config of no registered model family"):
        models.family_of(unregistered())  # a subclass of a family's config is not that family
