"""What every backend provides, and how the dispatcher picks one."""

from __future__ import annotations

import abc
import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from rankattn.blocks import BlockSizes
from rankattn.errors import fail
from rankattn.validate import AttentionCall


def compute_dtype(dtype):
    """The dtype of the math: at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _refuse(reached: str, forward_over_reverse: bool):
    raise fail("RA130", f"a second derivative reached {reached}. Take second derivatives with "
                        "impl='reference' (dense, small shapes)"
                        + (", or on 'xla' as jax.jvp of jax.grad (forward over reverse)."
                           if forward_over_reverse else "."))


# The identity on a tangent, linear, whose transpose raises RA130: forward over reverse runs
# through it (under jvp, vmap and jit it is x itself), reverse over reverse reaches its
# transpose. (jax.custom_derivatives.linear_call does the same but has no batching rule, so
# jax.hessian and vmapped Hessian-vector products failed.)
_no_transpose_p = Primitive("rankattn_tangent_without_transpose")
_no_transpose_p.def_impl(lambda x, *, reached: x)
_no_transpose_p.def_abstract_eval(lambda x, *, reached: x)
mlir.register_lowering(_no_transpose_p, lambda ctx, x, *, reached: [x])
batching.primitive_batchers[_no_transpose_p] = (
    lambda args, dims, *, reached: (_no_transpose_p.bind(args[0], reached=reached), dims[0]))
ad.deflinear2(_no_transpose_p, lambda ct, x, *, reached: _refuse(reached, True))


def first_derivatives_only(backend: str, *, forward_over_reverse: bool = False,
                           reached: str | None = None):
    """Decorate a kernel function (a static first argument, then arrays) that JAX may not
    differentiate: a custom VJP's primal kernel or its backward rule.

    The attention's first derivatives come from its custom VJP; a second derivative would
    differentiate these functions themselves (their FFI calls, Pallas kernels or dynamic
    loops), which fails deep in JAX. Instead, differentiating one raises RA130 naming
    ``backend`` (or saying what it ``reached``: a phrase that ends the sentence). With
    ``forward_over_reverse``, forward mode goes through (``jax.jvp`` of ``jax.grad``:
    Hessian-vector products, ``jax.hessian``; the xla backend's loops have a JVP) and only
    transposing that JVP, i.e. reverse over reverse, raises.
    """
    reached = reached or f"the {backend} backend, whose kernels give first derivatives only"

    def decorate(kernel):
        wrapped = jax.custom_jvp(kernel, nondiff_argnums=(0,))

        @wrapped.defjvp
        def _jvp(static, primals, tangents):
            if not forward_over_reverse:
                _refuse(reached, False)
            out, tangent = jax.jvp(functools.partial(kernel, static), primals, tangents)
            return out, jax.tree.map(lambda t: _no_transpose_p.bind(t, reached=reached),
                                     tangent)

        return wrapped

    return decorate


class Backend(abc.ABC):
    """One implementation of :func:`rankattn.attention`, with identical semantics to the others."""

    name: str
    # Whether it takes AttentionCall.shard_mask, i.e. can be the per-shard kernel of
    # context (sequence) sharding in rankattn.distributed.
    takes_shard_mask: bool = False

    def platform_reasons(self) -> list[str]:
        """Why this backend cannot run on this machine at all; empty when it can.

        Consulted when the backend is chosen by name or by ``impl='auto'``, not
        for an instance passed as ``impl=``: an explicit instance may be traced
        here and lowered for another platform.
        """
        return []

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Why this backend cannot run ``call``; empty when it can."""
        return []

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        """Why ``impl='auto'`` passes this backend over for ``call`` although it could run it
        (consulted after :meth:`not_supported_reasons`, for 'auto' only); empty when it
        takes it."""
        return []

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        """The block sizes of the :class:`rankattn.Plan` lists this backend may read for
        sequences of ``seq_len`` tokens (every dtype and head dim it may be called with)."""
        return ()

    @abc.abstractmethod
    def __call__(self, call: AttentionCall):
        """(out [B, S, Hq, Dv] in q's dtype, lse [B, Hq, S] in compute_dtype(q.dtype))."""

    def __repr__(self) -> str:
        return f"<rankattn backend {self.name!r}>"

    # A backend is its options (set once, in __init__), so two instances of one configuration
    # are equal and hash alike: jit caches a program per static impl=, and serving.attend's
    # compiled a new one for every Cpu(BlockSizes(...)) made per request.
    def _options(self) -> tuple:
        return tuple(sorted(vars(self).items()))

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._options() == self._options()

    def __hash__(self) -> int:
        return hash((type(self), self._options()))
