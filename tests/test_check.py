"""Never silently wrong: `jaxpar check` compares one step of a layout with one device weight by
weight, and the manual path refuses the partial sums a later sum would hide."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import cli
from jaxpar.errors import LayoutError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.nn import cross_entropy, embed_lookup, enter_block, reduce_partial
from jaxpar.train.step import TrainConfig, Trainer

TOKENS = np.random.default_rng(0).integers(0, 64, (8, 17), dtype=np.int32)


def test_check_passes_on_a_correct_layout_of_the_tiny_llama(capsys):
    # DP x FSDP x TP x SP at once (every layout equals one device: test_equivalence.py)
    assert cli.main(["check", "--strategy", "data=2,fsdp=2,tensor=2,sp=on", "--batch-size", "8", "--seq-len", "16"]) == 0
    assert "12 of 12 weights match" in capsys.readouterr().out


def test_check_takes_a_block_diffusion_model(capsys):
    # its batch is [x_t ; x_0] with noise levels, made as the main job makes it (train.data.family_batch_at)
    argv = ["check", "--model", "bd3lm-tiny", "--strategy", "data=2,fsdp=2,tensor=2", "--batch-size", "4", "--seq-len", "32"]
    assert cli.main(argv) == 0
    assert "12 of 12 weights match" in capsys.readouterr().out


def test_check_fails_on_a_broken_layout_naming_the_weights():
    # query heads split over tensor but key/value heads kept whole: each device pairs its query heads
    # with the first key/value heads, not theirs; every shape, type and sum checks out (heads whole
    # with head_dim split, whose scores are partial sums, is refused before any step: partial_sums.py)
    broken = build_layout(parse_strategy("fsdp=4,tensor=2", 8), extra_rules={"kv_heads": ()})
    cfg = llama.CONFIGS["tiny"]
    trainer = Trainer(broken, lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, TrainConfig())
    report = trainer.check(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17), dtype=np.int32))
    assert not report.ok
    assert "layers/wq" in {w.path for w in report.failed}
    assert "FAIL layers/wq" in report.format()


# --- a model written for the manual path (jaxpar's calls), with one mistake each ---------------

NAMES = ("batch", "length", "embed")


class ManualModel(nnx.Module):
    """Vocab-parallel embedding and loss, a Megatron MLP block."""

    def __init__(self, rngs, lookup="jaxpar", finish_sum=True):
        p = lambda names, shape, scale: nnx.Param(nnx.with_partitioning(nnx.initializers.normal(scale), names)(rngs.params(), shape))  # noqa: E731
        self.table = p(("vocab", "embed"), (64, 16), 1.0)
        self.up = p(("embed", "mlp"), (16, 32), 0.25)
        self.down = p(("mlp", "embed"), (32, 16), 0.18)
        self.lookup, self.finish_sum = lookup, finish_sum

    def __call__(self, tokens):
        table = self.table[...]
        if self.lookup == "jaxpar":
            x = embed_lookup(table, tokens, NAMES)
        elif self.lookup == "one-hot":  # the local shard's rows, as if they were the whole table
            x = jax.nn.one_hot(tokens, table.shape[0]) @ table
        else:  # what nnx.Embed does: a take from the table it holds
            x = jnp.take(table, tokens, axis=0, mode="clip")
        h = enter_block(x, NAMES, NAMES)
        out = jax.nn.gelu(h @ self.up[...]) @ self.down[...]
        x = x + (reduce_partial(out, ("mlp",), NAMES) if self.finish_sum else out)
        logits = enter_block(x, NAMES, NAMES) @ self.table[...].T
        return logits


def manual_loss(model, tokens):
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], ("batch", "length", "vocab"))


def manual_trainer(**kw):
    return Trainer(build_layout(parse_strategy("data=2,tensor=4", 8)), lambda rngs: ManualModel(rngs, **kw), manual_loss, TrainConfig())


def test_manual_model_passes_the_check():
    assert manual_trainer().check(TOKENS).ok


def test_a_forgotten_reduce_partial_is_refused_though_the_loss_hides_it():
    trainer = manual_trainer(finish_sum=False)
    state = trainer.init(seed=0)
    with pytest.raises(LayoutError, match=r"\('batch', 'length', 'embed'\).*tensor.*dot_general at .*test_check.py.*reduce_partial"):
        trainer.step(state, trainer.put_batch(TOKENS))


@pytest.mark.parametrize("lookup", ["one-hot", "take"])
def test_a_lookup_on_a_sharded_vocabulary_is_caught(lookup):
    # each device reads its shard of the table as if it were the whole: the looked-up rows differ
    # across tensor, which the next block entry refuses
    trainer = manual_trainer(lookup=lookup)
    state = trainer.init(seed=0)
    with pytest.raises(LayoutError, match="tensor"):
        trainer.step(state, trainer.put_batch(TOKENS))
