"""Every name Phoenix's own code uses from its three attention kernel modules exists in
rankattn.phoenix, with the parameters of Phoenix's definition and callable as Phoenix calls it.

The list below was read from x-algorithm at commit 28e414f (the mirror szq0017/x-algorithm):
every .py file of phoenix/ was searched for imports of ranker_attention_fa3 / _v2 / _varlen
(``from xrex.pallas import ...``, ``from xrex.pallas.ranker_attention_varlen import ...``) and
for the attributes read through them. The kernel modules themselves import nothing from one
another (fa3 imports ranker_attention_utils, v2 imports ranker_attention._preprocess_backward,
neither of them one of the three). With a Phoenix checkout in ``PHOENIX_SRC`` (the folder
holding ``phoenix/``), :func:`test_the_list_is_phoenix_s_own` derives the list again from the
source and compares.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib

import pytest

from rankattn.phoenix import ranker_attention_fa3, ranker_attention_v2, ranker_attention_varlen

MODULES = {"ranker_attention_fa3": ranker_attention_fa3,
           "ranker_attention_v2": ranker_attention_v2,
           "ranker_attention_varlen": ranker_attention_varlen}
REQUIRED = object()  # a parameter without a default

# (module, name) -> (line of Phoenix's definition in phoenix/xrex/pallas/<module>.py,
#                    its parameters (or dataclass fields) in order, with their defaults).
# Defaults that Phoenix names by a module constant are given by value (v2's BLOCK_* = 128 /
# 16); varlen's ``config=HOPPER_CONFIG`` is compared with the module's HOPPER_CONFIG.
DEFINITIONS = {
    ("ranker_attention_fa3", "TuningConfig"): (44, [
        ("block_q", REQUIRED), ("block_kv", REQUIRED), ("max_concurrent_steps", REQUIRED),
        ("use_schedule_barrier", True), ("causal", False), ("compute_wgs_bwd", 1),
        ("block_q_dkv", None), ("block_kv_dkv", None), ("block_q_dq", None),
        ("block_kv_dq", None)]),
    ("ranker_attention_fa3", "_normalize_bound"): (406, [
        ("bound", REQUIRED), ("batch_size", REQUIRED), ("seq_len", REQUIRED)]),
    ("ranker_attention_fa3", "attention"): (428, [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("config", REQUIRED),
        ("save_residuals", False), ("bound", None), ("sm_scale", 1.0), ("cap", -1.0),
        ("cap_method", "tanh"), ("z_loss_weight", 0.0)]),
    ("ranker_attention_fa3", "_attention_forward_inference"): (1242, [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("config", REQUIRED),
        ("bound", None), ("sm_scale", 1.0), ("cap", -1.0), ("cap_method", "tanh")]),
    ("ranker_attention_v2", "mha"): (442, [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("temp", REQUIRED),
        ("segment_ids", REQUIRED), ("sm_scale", 1.0), ("cap", -1.0), ("cap_method", "tanh"),
        ("causal", True), ("window_len", -1), ("z_loss_weight", 0.0), ("block_q_fwd", 128),
        ("block_k_fwd", 128), ("block_q_bwd_dq", 128), ("block_k_bwd_dq", 16),
        ("block_q_bwd_dkv", 16), ("block_k_bwd_dkv", 128), ("backward_pass_impl", "triton_split"),
        ("num_warps", None), ("num_stages", 2), ("grid", None), ("interpret", False),
        ("debug", False)]),
    ("ranker_attention_v2", "mha_inference_gqa"): (328, [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("temp", REQUIRED),
        ("segment_ids", REQUIRED), ("sm_scale", 1.0), ("cap", -1.0), ("cap_method", "tanh"),
        ("block_q", 128), ("block_k", 128), ("num_warps", None), ("num_stages", 2),
        ("interpret", False), ("debug", False)]),
    ("ranker_attention_varlen", "mha"): (391, [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("temp", REQUIRED),
        ("segment_ids", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
        ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), ("sm_scale", 1.0), ("cap", -1.0),
        ("cap_method", "tanh"), ("causal", True), ("window_len", -1), ("z_loss_weight", 0.0),
        ("config", "HOPPER_CONFIG"), ("backward_pass_impl", "triton_split"), ("grid", None),
        ("interpret", False), ("debug", False)]),
    ("ranker_attention_varlen", "get_device_tuning_config"): (69, []),
}

# Parameters Phoenix requires that rankattn lets callers leave out (every Phoenix call still
# binds): fa3 attention's ``config``, which rankattn ignores.
OPTIONAL_HERE = {("ranker_attention_fa3", "attention", "config")}

# Every use outside the kernel modules: (module, name, file, line, positional arguments,
# keyword names, attributes read from the result). Files are relative to the repository.
MODEL = "phoenix/xrex/models/recsys_attention.py"
TRAINER = "phoenix/xrex/train/trainer_recsys.py"
USES = [
    ("ranker_attention_fa3", "TuningConfig", MODEL, 48, 0,
     ("block_q", "block_kv", "max_concurrent_steps", "compute_wgs_bwd", "block_q_dkv",
      "block_kv_dkv", "block_q_dq", "block_kv_dq"), ()),
    ("ranker_attention_fa3", "attention", MODEL, 58, 4,
     ("save_residuals", "bound", "sm_scale", "cap", "cap_method"), ()),
    ("ranker_attention_v2", "mha", MODEL, 76, 5,
     ("causal", "sm_scale", "cap", "cap_method", "backward_pass_impl", "interpret"), ()),
    ("ranker_attention_fa3", "TuningConfig", MODEL, 117, 0,
     ("block_q", "block_kv", "max_concurrent_steps", "block_q_dkv", "block_kv_dkv", "block_q_dq",
      "block_kv_dq"), ()),
    ("ranker_attention_fa3", "_normalize_bound", MODEL, 127, 3, (), ()),
    ("ranker_attention_fa3", "_attention_forward_inference", MODEL, 128, 3,
     ("config", "bound", "sm_scale", "cap", "cap_method"), ()),
    ("ranker_attention_v2", "mha_inference_gqa", MODEL, 142, 5,
     ("sm_scale", "cap", "cap_method"), ()),
    ("ranker_attention_varlen", "mha", MODEL, 176, 7,
     ("max_seqlen_q", "max_seqlen_k", "sm_scale", "cap", "cap_method", "causal"), ()),
    ("ranker_attention_varlen", "get_device_tuning_config", TRAINER, 1697, 0, (), ("block_q",)),
]
# The imports that bring them in: (module, name or None for the module itself, file, line).
IMPORTS = [
    ("ranker_attention_fa3", None, MODEL, 32), ("ranker_attention_v2", None, MODEL, 71),
    ("ranker_attention_fa3", None, MODEL, 102), ("ranker_attention_v2", None, MODEL, 140),
    ("ranker_attention_varlen", None, MODEL, 158),
    ("ranker_attention_varlen", "get_device_tuning_config", TRAINER, 1695),
]


def test_the_list_names_every_definition_once():
    assert {(m, n) for m, n, *_ in USES} == set(DEFINITIONS)
    assert len(DEFINITIONS) == 8


@pytest.mark.parametrize("module, name", sorted(DEFINITIONS), ids=lambda x: x)
def test_each_name_has_phoenix_s_parameters(module, name):
    """Same parameter names in the same order with the same defaults (but OPTIONAL_HERE);
    anything rankattn adds comes after them, keyword-only (``impl=``)."""
    obj = getattr(MODULES[module], name)
    assert callable(obj)
    want = DEFINITIONS[module, name][1]
    parameters = list(inspect.signature(obj).parameters.values())
    assert [p.name for p in parameters[:len(want)]] == [n for n, _ in want]
    for p, (_, default) in zip(parameters, want):
        assert p.kind == p.POSITIONAL_OR_KEYWORD, p
        if default is REQUIRED:
            assert p.default is (None if (module, name, p.name) in OPTIONAL_HERE else p.empty), p
        elif default == "HOPPER_CONFIG":
            assert p.default is MODULES[module].HOPPER_CONFIG
        else:
            assert p.default == default and type(p.default) is type(default), p
    assert all(p.kind == p.KEYWORD_ONLY and p.default is not p.empty
               for p in parameters[len(want):]), parameters[len(want):]


@pytest.mark.parametrize("use", USES, ids=lambda u: f"{u[2].rsplit('/', 1)[1]}:{u[3]}")
def test_each_use_binds_as_phoenix_calls_it(use):
    module, name, _, _, positional, keywords, attributes = use
    obj = getattr(MODULES[module], name)
    inspect.signature(obj).bind(*range(positional), **dict.fromkeys(keywords))
    if attributes:  # only get_device_tuning_config: its result's fields
        result = obj()
        for attribute in attributes:
            assert hasattr(result, attribute)


def test_imports_resolve():
    import importlib

    for module, name, _, _ in IMPORTS:
        imported = importlib.import_module(f"rankattn.phoenix.{module}")
        assert name is None or hasattr(imported, name)


# --- Derive the list again from Phoenix's source, when a checkout is at hand. ---------------

_KERNELS = tuple(MODULES)


def _scan(root: pathlib.Path):
    """(uses, imports) of the three kernel modules in every .py file under root/phoenix, in
    the forms of USES / IMPORTS, from the syntax tree (imports are matched to the nearest
    preceding import of that name, so that a name imported from another module in a sibling
    branch is not counted)."""
    uses, imports = set(), set()
    for path in sorted((root / "phoenix").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "/pallas/ranker_attention_" in relative:
            continue  # the kernel modules themselves (they do not import one another)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_aliases, name_imports = {}, {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in _KERNELS and node.module.endswith("pallas"):
                    module_aliases[local] = alias.name
                    imports.add((alias.name, None, relative, node.lineno))
                kernel = node.module.rsplit(".", 1)[-1]
                target = (kernel, alias.name) if kernel in _KERNELS else None
                name_imports.setdefault(local, []).append((node.lineno, target))
                if target:
                    imports.add((*target, relative, node.lineno))
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        reads = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
                reads.setdefault(id(node.value), []).append(node.attr)
        for node in ast.walk(tree):
            target = None
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases):
                target = (module_aliases[node.value.id], node.attr)
            elif (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                    and node.id in name_imports):
                earlier = [t for line, t in sorted(name_imports[node.id]) if line <= node.lineno]
                target = earlier[-1] if earlier else None
            if target is None:
                continue
            call = calls.get(id(node))
            assert call is not None, f"{relative}:{node.lineno} reads {target} without calling it"
            uses.add((*target, relative, node.lineno, len(call.args),
                      tuple(k.arg for k in call.keywords), tuple(reads.get(id(call), ()))))
    return uses, imports


@pytest.mark.skipif(not os.environ.get("PHOENIX_SRC"),
                    reason="set PHOENIX_SRC to a Phoenix checkout (the folder holding phoenix/)")
def test_the_list_is_phoenix_s_own():
    uses, imports = _scan(pathlib.Path(os.environ["PHOENIX_SRC"]))
    assert uses == set(USES)
    assert imports == set(IMPORTS)


def test_get_device_tuning_config_regression():
    """Regression (missing name): Phoenix's trainer sizes its seqpack layout by
    ``get_device_tuning_config().block_q`` (trainer_recsys.py:1694-1697): 128, Phoenix's
    Hopper configuration, with no GPU queried (Blackwell's differs only in key blocks)."""
    config = ranker_attention_varlen.get_device_tuning_config()
    assert config == ranker_attention_varlen.HOPPER_CONFIG
    assert config.block_q == ranker_attention_varlen.BLACKWELL_CONFIG.block_q == 128
    assert (config.block_kv, ranker_attention_varlen.BLACKWELL_CONFIG.block_kv) == (128, 64)
