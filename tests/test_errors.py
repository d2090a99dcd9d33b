"""Every error path of rankattn.attention (RA1xx): code, exception types, and a message that names
the offending values; the generated docs/errors.md; and `rankattn.errors.explain`.

ERROR_CASES is the one table: each row is a call that must fail, the code, the builtin
exception it must also be (written here, not read from the catalog), and fragments of the
message. `test_every_core_code_has_a_case` checks the table covers the whole RA1xx catalog.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
import rankattn.phoenix
from helpers import assert_explained, message_body
from rankattn import errors
from rankattn.backends import BlockSizes

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def x(b=2, s=8, h=2, d=8, dtype=np.float32):
    return np.zeros((b, s, h, d), dtype)


def attend(q=None, k=None, v=None, **kwargs):
    q = x() if q is None else q
    return rankattn.attention(q, x() if k is None else k, x() if v is None else v, **kwargs)


SEG = np.ones((2, 8), np.int32)
V, T = ValueError, TypeError


def mesh(**axes):
    """A mesh of the one CPU device repeated: enough for checks that run before any trace."""
    sizes = tuple(axes.values())
    devices = np.array([jax.devices()[0]] * int(np.prod(sizes)), dtype=object)
    return jax.sharding.Mesh(devices.reshape(sizes), tuple(axes))


def sharded(sharding=None, **kwargs):
    return lambda: attend(sharding=sharding() if callable(sharding) else sharding, **kwargs)


def shard(**kwargs):
    axes = kwargs.pop("axes", dict(data=2, seq=4))
    return lambda: rankattn.Sharding(mesh(**axes), **kwargs)

# (id, code, builtin type, call, message fragments)
ERROR_CASES = [
    ("q-3d", "RA101", T, lambda: attend(q=np.zeros((2, 8, 16), np.float32)), ["q", "(2, 8, 16)", "3-D"]),
    ("k-5d", "RA101", T, lambda: attend(k=np.zeros((2, 8, 2, 8, 1), np.float32)), ["k", "5-D"]),
    ("v-list", "RA101", T, lambda: attend(v=[[1.0]]), ["v", "list"]),
    ("batch", "RA102", V, lambda: attend(k=x(b=3), v=x(b=3)), ["q 2", "k 3", "v 3"]),
    ("kv-length", "RA102", V, lambda: attend(v=x(s=9)), ["(2, 8, 2, 8)", "(2, 9, 2, 8)"]),
    ("kv-heads", "RA102", V, lambda: attend(v=x(h=1)), ["(2, 8, 2, 8)", "(2, 8, 1, 8)"]),
    ("head-dim", "RA102", V, lambda: attend(k=x(d=16)), ["head dim 8", "head dim 16"]),
    ("gqa-12-8", "RA103", V, lambda: attend(q=x(h=12), k=x(h=8), v=x(h=8)), ["12", "8"]),
    ("gqa-2-4", "RA103", V, lambda: attend(k=x(h=4), v=x(h=4)), ["2 heads", "has 4"]),
    ("int-q", "RA104", T, lambda: attend(q=x(dtype=np.int32)), ["q", "int32"]),
    ("bool-v", "RA104", T, lambda: attend(v=x(dtype=np.bool_)), ["v", "bool"]),
    ("mixed", "RA104", T, lambda: attend(k=x(dtype=jnp.bfloat16)), ["float32", "bfloat16"]),
    ("zero-seq", "RA105", V, lambda: attend(q=x(s=0)), ["q", "(2, 0, 2, 8)"]),
    ("zero-dim", "RA105", V, lambda: attend(v=x(d=0)), ["v", "(2, 8, 2, 0)"]),
    ("len-seg", "RA106", V, lambda: attend(k=x(s=5), v=x(s=5), segment_ids=SEG),
     ["segment_ids", "length 8", "length 5"]),
    ("len-bounds", "RA106", V, lambda: attend(k=x(s=5), v=x(s=5), bounds=(0, 2, 2, 5)), ["bounds"]),
    ("len-causal", "RA106", V, lambda: attend(k=x(s=5), v=x(s=5), causal=True), ["causal=True"]),
    ("seg-shape", "RA107", T, lambda: attend(segment_ids=np.ones((2, 9), np.int32)),
     ["(2, 9)", "(2, 8)"]),
    ("seg-1d", "RA107", T, lambda: attend(segment_ids=np.ones(8, np.int32)), ["(8,)", "(2, 8)"]),
    ("seg-float", "RA107", T, lambda: attend(segment_ids=SEG.astype(np.float32)), ["float32"]),
    ("seg-list", "RA107", T, lambda: attend(segment_ids=[[1] * 8] * 2), ["list"]),
    ("bounds-shape", "RA108", T, lambda: attend(bounds=np.zeros((3, 4), np.int32)), ["(3, 4)", "(2, 4)"]),
    ("bounds-5", "RA108", T, lambda: attend(bounds=np.zeros(5, np.int32)), ["(5,)"]),
    ("bounds-float", "RA108", T, lambda: attend(bounds=np.array([0.0, 2, 2, 8])), ["float64"]),
    ("bounds-ragged", "RA108", T, lambda: attend(bounds=[[0, 1], [2]]),
     ["bounds", "[[0, 1], [2]]", "rectangular", "[B, 4]"]),
    ("bounds-past-end", "RA109", V, lambda: attend(bounds=(0, 4, 4, 9)), ["(0, 4, 4, 9)", "S = 8"]),
    ("bounds-negative", "RA109", V, lambda: attend(bounds=[[0, 4, 4, 8], [-1, 2, 2, 8]]),
     ["row 1", "(-1, 2, 2, 8)"]),
    ("bounds-reversed", "RA109", V, lambda: attend(bounds=(5, 3, 6, 8)), ["(5, 3, 6, 8)"]),
    ("both-masks", "RA110", V, lambda: attend(segment_ids=SEG, bounds=(0, 2, 2, 8)),
     ["segment_ids", "bounds"]),
    ("softcap-0", "RA111", V, lambda: attend(softcap=0.0), ["softcap=0.0"]),
    ("softcap-neg", "RA111", V, lambda: attend(softcap=-3), ["softcap=-3"]),
    ("softcap-inf", "RA111", V, lambda: attend(softcap=float("inf")), ["softcap=inf"]),
    ("softcap-nan", "RA111", V, lambda: attend(softcap=float("nan")), ["softcap=nan"]),
    ("softcap-method", "RA112", V, lambda: attend(softcap=2.0, softcap_method="tan"),
     ["'tan'", "'tanh'", "'soft_sign'"]),
    ("scale-0", "RA113", V, lambda: attend(scale=0.0), ["0.0"]),
    ("scale-inf", "RA113", V, lambda: attend(scale=float("-inf")), ["-inf"]),
    ("scale-nan", "RA113", V, lambda: attend(scale=float("nan")), ["nan"]),
    ("impl-name", "RA114", V, lambda: attend(impl="cuda"), ["'cuda'", "'xla'", "'reference'"]),
    ("impl-class", "RA114", V, lambda: attend(impl=rankattn.backends.Xla), ["Xla"]),
    ("causal-int", "RA116", T, lambda: attend(causal=1), ["causal", "int"]),
    ("causal-array", "RA116", T, lambda: attend(causal=jnp.array(True)), ["causal"]),
    ("return-lse-str", "RA116", T, lambda: attend(return_lse="yes"), ["return_lse", "str"]),
    ("block-zero", "RA116", T, lambda: BlockSizes(0, 8), ["block_q", "0"]),
    ("block-float", "RA116", T, lambda: BlockSizes(16, 8.0), ["block_k", "8.0"]),
    # Regression (review): these failed later, inside a call (max() of an empty sequence), or
    # took a truthy string as True.
    ("xla-step-bytes", "RA116", T, lambda: rankattn.backends.Xla(step_logits_bytes=-1),
     ["step_logits_bytes=-1", "positive int"]),
    ("xla-mixed-str", "RA116", T, lambda: rankattn.backends.Xla(mixed_precision="no"),
     ["mixed_precision='no'", "True, False or None"]),
    ("triton-split-str", "RA116", T,
     lambda: rankattn.backends.PallasTriton(split_dkv="no"), ["split_dkv='no'"]),
    ("plan-no-mask", "RA117", V, lambda: rankattn.plan(), ["segment_ids or bounds"]),
    ("plan-bounds-no-len", "RA117", V, lambda: rankattn.plan(bounds=(0, 2, 2, 8)), ["seq_len"]),
    ("plan-zero-seq", "RA105", V, lambda: rankattn.plan(segment_ids=np.ones((2, 0), np.int32)),
     ["segment_ids", "(2, 0)", "S >= 1"]),
    ("plan-zero-batch", "RA105", V, lambda: rankattn.plan(segment_ids=np.ones((0, 8), np.int32)),
     ["(0, 8)", "B >= 1"]),
    ("plan-and-seg", "RA117", V, lambda: attend(plan=rankattn.plan(segment_ids=SEG), segment_ids=SEG),
     ["plan", "together with segment_ids"]),
    ("plan-and-bounds", "RA117", V,
     lambda: attend(plan=rankattn.plan(segment_ids=SEG), bounds=(0, 2, 2, 8)),
     ["plan", "together with bounds"]),
    ("plan-and-causal", "RA117", V, lambda: attend(plan=rankattn.plan(segment_ids=SEG), causal=True),
     ["plan", "causal"]),
    ("seg-bool", "RA107", T, lambda: attend(segment_ids=SEG > 0), ["bool", "astype(jnp.int32)"]),
    ("seg-wide", "RA118", V, lambda: attend(segment_ids=SEG.astype(np.int64) * 2**31),
     ["2147483648", "2147483647"]),
    ("seg-int32-min", "RA118", V, lambda: attend(segment_ids=np.full((2, 8), -2**31, np.int32)),
     ["-2147483648"]),
    ("seg-uint64", "RA118", V, lambda: attend(segment_ids=np.full((2, 8), 2**40, np.uint64)),
     [str(2**40)]),
    ("plan-shape", "RA117", V, lambda: attend(plan=rankattn.plan(segment_ids=np.ones((3, 8), np.int32))),
     ["(3, 8)", "B=2"]),
    ("mesh-axis", "RA119", V, shard(batch="batch"), ["batch='batch'", "'batch'", "('data', 'seq')"]),
    ("mesh-axis-twice", "RA119", V, shard(batch="data", context=("seq", "data")),
     ["'data'", "batch=", "context="]),
    # Regression (review): listed out of the mesh's order, the causal reorder's permutes moved
    # chunks to the wrong shards (ppermute numbers shards in mesh order).
    ("context-out-of-mesh-order", "RA119", V, shard(context=("seq", "data")),
     ["context=('seq', 'data')", "('data', 'seq')"]),
    ("mesh-not-a-mesh", "RA119", V, lambda: rankattn.Sharding("data", batch="data"), ["str"]),
    ("sharding-not-a-sharding", "RA119", V, sharded("data"), ["rankattn.Sharding", "str"]),
    ("batch-not-divisible", "RA120", V, sharded(shard(batch="seq")),
     ["batch=('seq',)", "4 shards", "B = 2", "pad the batch"]),
    ("heads-not-divisible", "RA120", V, sharded(shard(heads="seq"), q=x(h=4)),
     ["heads=('seq',)", "Hq and Hkv = 4, 2"]),
    ("context-not-divisible", "RA120", V,
     sharded(shard(context=("data", "seq")), q=x(s=12), k=x(s=12), v=x(s=12)),
     ["8 shards", "S = 12", "segment id 0 to 16"]),
    ("balanced-layout-length", "RA120", V,
     sharded(shard(context="seq", balanced_layout=True), q=x(s=12), k=x(s=12), v=x(s=12)),
     ["2 x 4 chunks", "S = 12", "to 16"]),
    ("balanced-layout-no-context", "RA121", V, shard(batch="data", balanced_layout=True),
     ["balanced_layout=True", "context="]),
    ("balanced-layout-int", "RA116", T, shard(context="seq", balanced_layout=1),
     ["balanced_layout=1"]),
    ("strategy-name", "RA121", V, shard(context="seq", strategy="ulysses"),
     ["'ulysses'", "'ring'", "'all_gather'"]),
    ("strategy-without-context", "RA121", V, shard(batch="data", strategy="ring"),
     ["strategy='ring'", "context="]),
    ("context-cross-attention", "RA121", V, sharded(shard(context="seq"), k=x(s=4), v=x(s=4)),
     ["length 8", "k 4", "self-attention"]),
    ("context-pallas", "RA122", V,
     sharded(shard(context="seq"), impl=rankattn.backends.PallasTriton(interpret=True)),
     ["pallas_triton", "context shard", "impl='xla'"]),
    ("cu-seqlens-decreasing", "RA123", V,
     lambda: rankattn.segment_ids_from_cu_seqlens(np.array([0, 5, 3]), length=8),
     ["[0, 5, 3]", "non-decreasing", "T = 8"]),
    ("cu-seqlens-ragged", "RA123", V,
     lambda: rankattn.segment_ids_from_cu_seqlens([[0, 2], [4]], length=4),
     ["cu_seqlens", "[[0, 2], [4]]", "rectangular", "1-D int"]),
    ("plan-impls", "RA125", V, lambda: rankattn.plan(segment_ids=SEG, impls=["xla"]),
     ["impls=['xla']", "impl=['xla']"]),
    ("multiplier-shape", "RA127", T, lambda: attend(logit_multiplier=np.ones((2, 7))),
     ["logit_multiplier", "(2, 7)", "[B, Sq] = (2, 8)"]),
    ("multiplier-ragged", "RA127", T, lambda: attend(logit_multiplier=[[1, 2], [3]]),
     ["logit_multiplier", "[[1, 2], [3]]", "rectangular", "[B, Sq]"]),
    ("mosaic-interpret-under-jit", "RA128", V,
     lambda: jax.jit(lambda q: attend(q=q, k=q, v=q, impl=rankattn.backends.MosaicGpu(
         interpret=True)))(x(dtype=jnp.bfloat16)),
     ["MosaicGpu(interpret=True)", "jax.jit", "eagerly"]),
    ("impl-empty-list", "RA114", V, lambda: attend(impl=[]), ["impl=[]", "names no backend"]),
    ("plan-seq-len-of-other-ids", "RA117", V, lambda: rankattn.plan(segment_ids=SEG, seq_len=5),
     ["seq_len=5", "length 8"]),
    ("phoenix-z-loss-nan", "RA129", V,
     lambda: rankattn.phoenix.ranker_attention_v2.mha(x(), x(h=1), x(h=1), np.ones((2, 8)), SEG,
                                                      z_loss_weight=float("nan")),
     ["z_loss_weight=nan", "finite"]),
    ("grad-of-grad-on-xla", "RA130", V,
     lambda: jax.grad(lambda q: jax.grad(lambda q: attend(q=q, impl="xla").sum())(q).sum())(
         x() + 1), ["second derivative", "xla", "impl='reference'", "jax.jvp of jax.grad"]),
    ("phoenix-temp-shape", "RA124", V,
     lambda: rankattn.phoenix.ranker_attention_v2.mha(x(), x(h=1), x(h=1), np.ones((2, 9)), SEG),
     ["temp", "(2, 9)", "(2, 8)"]),
]


def raise_case(code, builtin, call, fragments):
    with pytest.raises(rankattn.RankattnError) as info:
        call()
    err = info.value
    assert isinstance(err, builtin), f"{type(err).__mro__} is not a {builtin.__name__}"
    assert err.code == code, str(err)
    message = str(err)
    assert message.startswith(f"[{code}]"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_explained(err)
    return message


@pytest.mark.parametrize("code, builtin, call, fragments", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_error(code, builtin, call, fragments):
    raise_case(code, builtin, call, fragments)


def test_gqa_message_lists_the_divisors():
    message = raise_case("RA103", V, lambda: attend(q=x(h=12), k=x(h=8), v=x(h=8)), [])
    listed = message.split("divides 12:")[1].split("\n")[0]
    assert [int(n) for n in re.findall(r"\d+", listed)] == [1, 2, 3, 4, 6, 12]


def test_impl_that_cannot_run(monkeypatch):
    import rankattn.backends.reference as reference

    monkeypatch.setattr(reference, "MAX_LOGITS_BYTES", 1000)
    # B=2 x Hq=2 x 8 x 8 x 4 bytes = 1024 bytes of logits > 1000.
    raise_case("RA115", V, lambda: attend(impl="reference"), ["impl='reference'", "reference", "xla"])
    # 'auto' still finds a backend that can run it, and impl='reference' runs smaller calls.
    assert attend(impl="auto").shape == (2, 8, 2, 8)
    assert attend(q=x(b=1), k=x(b=1), v=x(b=1), impl="reference").shape == (1, 8, 2, 8)


def test_traced_scale_is_rejected():
    raise_case("RA113", V, lambda: jax.jit(lambda s: attend(scale=s))(0.5), ["scale", "traced"])


def test_every_core_code_has_a_case():
    core = sorted(c for c in errors.CATALOG if c.startswith("RA1"))
    assert core == [f"RA1{i:02d}" for i in range(1, len(core) + 1)], "codes are not consecutive"
    # RA115: test_impl_that_cannot_run; RA126 (the C++ kernel's): tests/test_cpu_kernel_memory.py
    covered = {c[1] for c in ERROR_CASES} | {"RA115", "RA126"}
    assert covered == set(core)


def test_catalog_types_match_the_table():
    for _, code, builtin, _, _ in ERROR_CASES:
        assert issubclass(errors.CATALOG[code].kind, builtin), code
        assert issubclass(errors.CATALOG[code].kind, rankattn.RankattnError), code


# --- Regressions: bugs the first test pass found in the argument checks. ------------


@pytest.mark.parametrize("kwargs, code", [({"scale": "abc"}, "RA113"), ({"softcap": "abc"}, "RA111")])
def test_non_numeric_string_scale_or_softcap(kwargs, code):
    with pytest.raises(rankattn.RankattnError) as info:
        attend(**kwargs)
    assert info.value.code == code


def _outcome(call):
    try:
        call()
    except rankattn.RankattnError as e:
        return e.code
    return "ok"


def test_numpy_bools_are_treated_alike():
    assert _outcome(lambda: attend(causal=np.True_)) == _outcome(lambda: attend(return_lse=np.True_))


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
def test_float64_without_x64_is_rejected():
    """JAX would silently truncate to float32 and return float32."""
    assert not jax.config.jax_enable_x64
    q = np.zeros((1, 4, 2, 8), np.float64)
    with pytest.raises(rankattn.RankattnTypeError, match=r"RA104.*x64"):
        rankattn.attention(q, q, q)


# --- docs/errors.md and explain. --------------------------------------------------


def test_docs_match_the_catalog():
    assert DOCS.exists(), "generate it: rankattn explain --markdown > docs/errors.md"
    assert DOCS.read_text() == errors.render_markdown()


def test_docs_have_one_section_per_code():
    sections = re.findall(r"^## (RA\d{3}): ", DOCS.read_text(), flags=re.M)
    assert sections == sorted(errors.CATALOG)


def test_the_documented_command_regenerates_the_docs(capsys):
    """The file's header names the command that writes it; running that command reproduces it."""
    text = DOCS.read_text()
    command = re.search(r"by `(.+?) > docs/errors.md`", text).group(1).split()
    assert command[0] == "rankattn", command
    from rankattn import cli

    assert cli.main(command[1:]) == 0
    assert capsys.readouterr().out == text


def test_explain_a_code():
    text = errors.explain("RA103")
    assert text.startswith("RA103: query heads are not a multiple of kv heads")
    assert "What it means" in text and "How to fix it" in text
    assert errors.explain("ra103") == text                    # case-insensitive
    assert errors.explain("rankattn explain RA103 please") == text


@pytest.mark.parametrize("case_id", ["gqa-12-8", "seg-float", "bounds-reversed", "impl-name",
                                     "causal-int", "plan-shape"])
def test_explain_a_real_message(case_id):
    _, code, builtin, call, _ = next(c for c in ERROR_CASES if c[0] == case_id)
    message = raise_case(code, builtin, call, [])
    assert errors.explain(message).startswith(f"{code}: {errors.CATALOG[code].title}")


def test_explain_nothing():
    assert errors.explain("RA999") is None
    assert errors.explain("hello") is None
    assert errors.explain("") is None


@pytest.mark.parametrize("argv, said", [
    (["explain"], "give an error code"),
    (["explain", "--markdown", "RA103"], "--markdown prints every entry"),
    (["demo", "--batch", "0"], "--batch: '0' is not a whole number >= 1"),
    (["demo", "--repeats", "-1"], "--repeats: '-1' is not a whole number >= 1"),
    (["demo", "--batch", "two"], "'two' is not a whole number >= 1")])
def test_the_command_refuses_bad_arguments_with_usage_regression(capsys, argv, said):
    """Review (stop 72): `rankattn demo --batch 0` ended in a trace naming q, --repeats 0 printed
    NaN times and exited 0; `explain` with no query or beside --markdown said nothing useful."""
    from rankattn import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_explain_names_a_code_that_does_not_exist_regression(capsys):
    """Review (stop 72): "RA999 softcap" answered RA111's entry without saying RA999 is none."""
    from rankattn import cli

    assert cli.main(["explain", "RA999", "softcap"]) == 1
    assert "RA999: no such rankattn error code" in capsys.readouterr().err
    assert cli.main(["explain", "[RA111]", "softcap"]) == 0
    assert capsys.readouterr().out.startswith("RA111")


def test_every_code_has_a_raise_site():
    """explain reads each code's message templates from the fail(...) calls in the source; RA126
    comes from the C++ kernel (its message starts with the code)."""
    assert {code for code, _ in errors.message_templates()} == set(errors.CATALOG) - {"RA126"}


def test_dtype_messages_of_attention_and_serving_differ():
    """Regression: the body of an RA104 message scored exactly as much as RA213's entry, so the
    winner depended on the order a set iterated in (PYTHONHASHSEED)."""
    body = message_body(pytest.raises(rankattn.RankattnError, attend, q=x(dtype=np.int32)).value)
    assert errors.best_match(body) == "RA104"


EXPLAIN_SCRIPT = """
import json, sys
from rankattn import errors
import rankattn.serving
print(json.dumps([errors.best_match(t) for t in json.load(sys.stdin)]))
"""


def test_explain_does_not_depend_on_hash_seeds():
    bodies = []
    for _, code, builtin, call, _ in ERROR_CASES:
        with pytest.raises(rankattn.RankattnError) as info:
            call()
        bodies.append(message_body(info.value))
    bodies += ["hello", "q has dtype int32", "a serving input has a non-float dtype"]
    want = [errors.best_match(b) for b in bodies]
    for seed in range(3):  # each seed a process importing rankattn (about 3 s)
        got = subprocess.run([sys.executable, "-c", EXPLAIN_SCRIPT], input=json.dumps(bodies),
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONHASHSEED=str(seed)))
        assert json.loads(got.stdout) == want, f"PYTHONHASHSEED={seed}"


@pytest.mark.parametrize("kwargs, code", [(dict(scale=0.5 + 1j), "RA113"),
                                          (dict(softcap=np.complex64(3)), "RA111"),
                                          (dict(softcap=2.0, softcap_method=np.array(["tanh"])),
                                           "RA112")])
def test_complex_or_array_logit_options(kwargs, code):
    """Regression (found by tests/test_fuzz_args.py): float() dropped the imaginary part."""
    with pytest.raises(rankattn.RankattnError, match=code):
        attend(**kwargs)
