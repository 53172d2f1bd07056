"""Log-probs from hidden states in position x vocabulary chunks equal the unchunked ones (values, support,
entropy, gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.learner.logprobs import chunked_token_logprobs, token_logprobs
from jaxrl.rollout import SamplingParams

B, L, E, V = 2, 23, 16, 50


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=7, top_p=0.9),
    SamplingParams(top_p=0.8),
    SamplingParams(top_k=7),
    SamplingParams(greedy=True),  # a point mass: logprob 0, in support where the token is the argmax
])
def test_chunked_equals_unchunked(sampling):
  ks = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(ks[0], (B, L, E))
  head = jax.random.normal(ks[1], (E, V))
  tokens = jax.random.randint(ks[2], (B, L), 0, V)

  def full(h, w):
    logits = jnp.einsum("bte,ev->btv", h, w, preferred_element_type=jnp.float32)
    return token_logprobs(logits, tokens, sampling)

  # 22 positions = 4 x 5 + 2; 50 vocabulary entries = 3 x 16 + 2 (top-p alone scores all 50 at once).
  chunked = lambda h, w: chunked_token_logprobs(h, w, tokens, sampling, chunk=5, vocab_chunk=16)
  for a, b in zip(jax.jit(chunked)(hidden, head), jax.jit(full)(hidden, head), strict=True):
    assert a.shape == (B, L)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)  # float32 sums in another order
  def objective(f):
    def loss(h, w):
      logp, in_support, entropy = f(h, w)
      return jnp.sum(jnp.where(in_support, logp, 0.0)) + 0.1 * jnp.sum(entropy)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))

  grads, ref = objective(chunked)(hidden, head), objective(full)(hidden, head)
  for g, r in zip(grads, ref, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
